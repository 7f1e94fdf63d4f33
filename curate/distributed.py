"""Curation on dask.distributed, with the embedded engine's stages, SQL and bytes.

Invariants:
- A partition holds whole prompts: batch rows go to partition md5(prompt_id) mod P. So it holds
  whole groups (a group's rows share one prompt, checked at append) and the whole difficulty
  history of its prompts. The group-local stages (statistics, advantages, filter, difficulty,
  amplification, in-group and PODS selection) run inside the partition with the embedded engine's
  own stage helpers (`curate.run`) and the client's SQL text, shipped with every task.
- Global decisions are exact merges, never approximations: μ and the per-prompt history from
  integer counts; the cross-group max-variance subset by the same select SQL over every pool row's
  (rollout_id, advantage_final), gathered on the client; the token threshold from the per-shard
  histograms of the monotone score bucket, summed, then the head of the one bucket that holds the
  K-th token; the record's numbers by the record SQL over all candidates' narrow rows in one task.
- Curated shards are materialised per input shard and cut into exactly the embedded engine's
  parts (one task per output shard, so materialisation runs as wide as there are output shards),
  with the client's row-group sizing (its core count), so the worker's host does not change the
  bytes; workers write them, and the audit, only under BUFFER/tmp/curate-<run>/. Nothing is
  visible until the client links every file into place and commits them with the record in ONE
  `Buffer.commit`. On any failure (a lost worker past Dask's retries, an interrupt, an error) the
  run folder is removed and nothing is committed. Tasks are pure functions of their inputs, so a
  task that Dask reruns after losing a worker gives the same rows and bytes.
- The curation id hashes `stage_texts`, like the embedded engine: the engine is not part of the
  result, and a curation run on either engine is idempotent with the other.
- Workers never open the manifest (SQLite wants one host): they read the pinned snapshot's file
  list, and the buffer must be on storage every worker reads at the same path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from importlib import resources

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from queries.session import DEFAULT_MEMORY_LIMIT, Session
from storage.buffer import Buffer, Part, WrittenPart, token_count
from storage.schema import CURATED, CURATIONS, SELECTIONS, TABLES
from storage.shardio import READ_THREADS, write_tmp
from storage.snapshot import SnapshotFiles, sql_string

from .params import ParamError, Params, Recipe, resolve, token_budget
from .run import (
    CURATION_INPUTS,
    HISTOGRAM,
    MISSING_ENTROPIES,
    TOKEN_ORDER,
    CurationError,
    CurationResult,
    _score_expr,
    _Stages,
    _substitute,
    already_committed,
    batch_accuracy,
    batch_mu,
    curated_rows_per_shard,
    curated_table,
    curation_id_for,
    kept_counts_table,
    mask_parameters,
    materialise_shard,
    missing_entropies_error,
    new_record,
    pick_bucket,
    publish,
    run_summary,
    stage_amplify,
    stage_apply,
    stage_groups,
    stage_params,
    stage_select,
    stage_texts,
    texts_sha256,
)

NO_SELECTIONS = ("(SELECT NULL::VARCHAR AS rollout_id, NULL::VARCHAR AS curation_id, "
                 "NULL::BOOLEAN AS selected WHERE false)")
HISTORY_MERGE = ("SELECT prompt_id, sum(n)::BIGINT AS n, sum(k)::BIGINT AS k "
                 "FROM history_parts GROUP BY prompt_id")
DECISIONS = ("SELECT shard, rollout_id, selected, advantage_final, weight FROM work WHERE selected "
             "ORDER BY shard, rollout_id")


def require_dask():
    """The `distributed` module, or one clear error line when it is not installed."""
    try:
        import distributed
    except ImportError:
        raise CurationError("--engine dask needs dask.distributed: pip install 'rollstore[dask]'") from None
    return distributed


# ---- what every task gets --------------------------------------------------------------------
@dataclass(frozen=True)
class _Ctx:
    files: SnapshotFiles
    params: Params
    q: dict
    sql: dict  # stage name -> SQL text of the client's installation
    partitions: int
    memory_limit: str
    threads: int
    folder: str  # tmp/curate-<run>, relative to the buffer root
    write_threads: int  # the client's READ_THREADS: row groups as the embedded engine would cut them
    hooks: dict = field(default_factory=dict)  # tests: {task kind: seconds to sleep first, or "fail"}

    def shard(self, i: int) -> str:
        return self.files.listing["rollouts"][i]


def _start(ctx: _Ctx, kind: str) -> None:
    hook = ctx.hooks.get(kind)
    if hook == "fail":
        raise RuntimeError(f"test hook: {kind} task failed")
    if hook:
        time.sleep(hook)


class _TaskSession(Session):
    """The DuckDB session of a task that reads no snapshot table (only `work` and what it loads,
    or one input shard as `rollouts`): the limits and sandbox of `Session`, without its views."""

    def __init__(self, ctx: _Ctx, shard: str | None = None):
        self.snapshot = None
        self.root = ctx.files.root
        self.con = duckdb.connect(":memory:")
        self.spill_dir = os.path.join(self.root, "tmp", f"duckdb-{uuid.uuid4().hex[:12]}")
        self.con.execute(f"SET memory_limit={sql_string(ctx.memory_limit)}")
        self.con.execute(f"SET temp_directory={sql_string(self.spill_dir)}")
        self.con.execute("SET preserve_insertion_order=false")
        self.con.execute(f"SET threads={int(ctx.threads)}")
        if shard is not None:
            self.con.execute(f"CREATE VIEW rollouts AS SELECT * FROM read_parquet({sql_string(shard)}, "
                             "hive_partitioning = false)")
        self.lock()


def _session(ctx: _Ctx, shard: str | None = None, whole: bool = False) -> Session:
    """A sandboxed DuckDB session for a task: over the whole snapshot (`whole`), one input shard
    as `rollouts`, or nothing but what the task loads."""
    return Session(ctx.files, ctx.memory_limit, ctx.threads) if whole else _TaskSession(ctx, shard)


def _load(session: Session, name: str, table: pa.Table) -> None:
    session.con.register("_incoming", table)
    session.execute(f"CREATE OR REPLACE TEMP TABLE {name} AS SELECT * FROM _incoming")
    session.con.unregister("_incoming")


def _read(session: Session, sql: str, params: dict | None = None) -> pa.Table:
    return session.con.sql(sql, params=params).to_arrow_table()


def _split(table: pa.Table | None, column: str, n: int) -> list[pa.Table | None]:
    if table is None:
        return [None] * n
    return [table.filter(pc.equal(table.column(column), i)) for i in range(n)]


def _concat(tables: list[pa.Table]) -> pa.Table:
    return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]


@dataclass
class _State:
    """A partition between stages: its narrow `work` rows, its prompts' history, small numbers."""

    work: pa.Table
    history: pa.Table | None = None
    stats: dict = field(default_factory=dict)
    pool: pa.Table | None = None


@dataclass
class _Written:
    part: WrittenPart
    kept: pa.Table | None = None
    fallback: int = 0


def _get(obj, name: str):
    return getattr(obj, name)


def _item(obj, i: int):
    return obj[i]


# ---- tasks ------------------------------------------------------------------------------------
def _scan_defaults(ctx: _Ctx, i: int):
    """The latest (created_at, run_id, step) and the max policy_version of one input shard."""
    _start(ctx, "scan")
    with _session(ctx, ctx.shard(i)) as s:
        row = s.one("SELECT created_at, run_id, step FROM rollouts "
                    "ORDER BY created_at DESC, run_id DESC, step DESC LIMIT 1")
        version = s.one("SELECT max(policy_version) FROM rollouts")[0]
    return row, version


def _map_shard(ctx: _Ctx, i: int) -> list[tuple[pa.Table, pa.Table | None]]:
    """Step 1 (row-local) over one input shard, and its partial difficulty history, split by
    partition. The `where` predicate sees the whole snapshot, as in the embedded engine."""
    _start(ctx, "map")
    p, q = ctx.params, ctx.q
    source = f"read_parquet({sql_string(ctx.shard(i))}, hive_partitioning = false)"
    part = f"(md5_number(prompt_id) % {ctx.partitions})::INTEGER"
    with _session(ctx, whole=True) as s:
        stages = _Stages(s, ctx.sql)
        stages.run("curate_candidates", q, rollouts=f"{source} AS rollouts",
                   selections="selections" if q["max_reuse"] is not None else NO_SELECTIONS, where=p["where"])
        work = _read(s, f"SELECT *, {int(i)}::INTEGER AS shard, {part} AS part FROM work")
        history = None
        if p["amplify"] == "da3po":
            stages.run("curate_history", q, rows=source, out="history_parts")
            history = _read(s, f"SELECT *, {part} AS part FROM history_parts")
    return list(zip(_split(work, "part", ctx.partitions), _split(history, "part", ctx.partitions)))


def _partition_groups(ctx: _Ctx, *pieces) -> _State:
    """Steps 2–4 of one partition. With da3po: its share of μ's counts and its prompts' merged
    history, and the client's μ comes back in `_partition_select`; otherwise it goes on with
    step 5 and the local selection in the same task."""
    _start(ctx, "groups")
    p, q = ctx.params, ctx.q
    with _session(ctx) as s:
        stages = _Stages(s, ctx.sql)
        _load(s, "work", _concat([w for w, _ in pieces]))
        stats = {"n_candidates": s.one("SELECT count(*) FROM work")[0], "k": 0, "n": 0}
        stage_groups(stages, q)
        if p["amplify"] == "da3po":
            stats["k"], stats["n"] = batch_accuracy(stages, q)
            _load(s, "history_parts", _concat([h for _, h in pieces]))
            return _State(_read(s, "SELECT * FROM work"), _read(s, HISTORY_MERGE), stats)
        return _select_in(s, stages, ctx, None, stats)


def _partition_select(ctx: _Ctx, state: _State, mu: float | None) -> _State:
    """Step 5 and the local selection of a da3po run, given the batch's μ."""
    _start(ctx, "select")
    with _session(ctx) as s:
        _load(s, "work", state.work)
        _load(s, "prompt_history", state.history)
        return _select_in(s, _Stages(s, ctx.sql), ctx, mu, state.stats)


def _select_in(s: Session, stages: _Stages, ctx: _Ctx, mu: float | None, stats: dict) -> _State:
    """Step 5, then steps 6–7 when they are local (none, in-group, PODS); for the cross-group
    selection, the pool's (rollout_id, advantage_final) for the client's global decision."""
    p, q = ctx.params, ctx.q
    stage_amplify(stages, q, p, mu)
    pool = None
    if p["sample"] == "cross_group":
        pool = _read(s, "SELECT rollout_id, NULL::VARCHAR AS reason, advantage_final, part "
                        "FROM work WHERE reason IS NULL")
    else:
        stage_select(stages, q, p)
        stage_apply(stages, q, p)
    return _State(_read(s, "SELECT * FROM work"), stats=stats, pool=pool)


def _collect(ctx: _Ctx, picked: pa.Table | None, *states: _State) -> dict:
    """Every candidate's final narrow row in one table (the client's cross-group choice `picked`
    applied: a row-local join): the record's numbers, and per input shard the decisions
    (selected rows, their advantage and weight) that token scoring and materialisation need."""
    _start(ctx, "collect")
    p = ctx.params
    n_shards = len(ctx.files.listing["rollouts"])
    with _session(ctx) as s:
        stages = _Stages(s, ctx.sql)
        _load(s, "work", _concat([st.work for st in states]))
        if picked is not None:
            _load(s, "picked", picked)
            stage_apply(stages, ctx.q, p)
        summary = run_summary(stages, p)
        summary["sample_budget"] = (s.one("SELECT count(*) FROM work WHERE selected")[0]
                                    if p["sample"] != "none" else None)
        decisions = _split(_read(s, DECISIONS), "shard", n_shards)
        summary["selected_per_shard"] = [t.num_rows for t in decisions]
        work = _read(s, "SELECT * FROM work")
    return {"work": work, "summary": summary,
            "decisions": [t.drop_columns(["shard"]) if t.num_rows else None for t in decisions]}


def _token_histogram(ctx: _Ctx, i: int, decisions: pa.Table):
    """(first selected rollout without entropies, or None; the (bucket, count) histogram)."""
    _start(ctx, "tokens")
    token = ctx.params["token"]
    with _session(ctx, ctx.shard(i)) as s:
        _load(s, "work", decisions)
        missing = s.one(MISSING_ENTROPIES)
        if missing:
            return missing[0], []
        _Stages(s, ctx.sql).run("curate_token_scores", score=_score_expr(token, "h", "advantage_final"))
        return None, [(int(b), int(n)) for b, n in s.execute(HISTOGRAM).fetchall()]


def _token_head(ctx: _Ctx, i: int, decisions: pa.Table, bucket: int, n: int) -> pa.Table:
    """The first `n` tokens of one bucket of one shard, in the threshold's order."""
    _start(ctx, "tokens")
    token = ctx.params["token"]
    with _session(ctx, ctx.shard(i)) as s:
        _load(s, "work", decisions)
        _Stages(s, ctx.sql).run("curate_token_scores", score=_score_expr(token, "h", "advantage_final"))
        return _read(s, f"SELECT score, rollout_id, pos FROM token_scores WHERE bucket = $b {TOKEN_ORDER} "
                        f"LIMIT $n", {"b": bucket, "n": n})


def _write(ctx: _Ctx, table_name: str, table: pa.Table, relpath: str, key: str) -> WrittenPart:
    schema = TABLES[table_name]
    table = table.select(schema.names).cast(schema)  # exactly what Buffer.commit writes for a Part
    tmp, nbytes, sha = write_tmp(table, ctx.files.root, ctx.folder, ctx.write_threads)
    return WrittenPart(table_name, tmp, relpath, table.num_rows, token_count(table), nbytes, sha, key)


def _materialise_part(ctx: _Ctx, curation_id: str, name: str, slices: list, mask_params: dict,
                      materialise_sql: str, *decisions: pa.Table) -> _Written:
    """One curated shard: slices (shard, start, rows) of materialised input shards, written to tmp."""
    _start(ctx, "materialise")
    pieces, ids, counts, fallback = [], [], [], 0
    with _session(ctx) as s:
        for (i, start, rows), dec in zip(slices, decisions):
            _load(s, "work", dec)
            table = materialise_shard(s, ctx.shard(i), materialise_sql, mask_params).slice(start, rows)
            ids.extend(table.column("rollout_id").to_pylist())
            counts.extend(table.column("tokens_kept").to_pylist())
            fallback += int(pc.sum(table.column("fallback")).as_py() or 0)
            pieces.append(table)
    part = _write(ctx, "curated", curated_table(pieces, curation_id),
                  f"curated/{curation_id}/{name}.parquet", curation_id)
    return _Written(part, kept_counts_table(ids, counts), fallback)


def _write_audit(ctx: _Ctx, curation_id: str, collected: dict, *written: _Written) -> WrittenPart:
    """The audit: one row per candidate, in rollout_id order, written to tmp."""
    _start(ctx, "audit")
    kept = [w.kept for w in written]
    with _session(ctx) as s:
        _load(s, "work", collected["work"])
        s.con.register("kept_counts", _concat(kept) if kept else kept_counts_table([], []))
        audit = _Stages(s, ctx.sql).table("curate_audit", {"curation_id": curation_id}).cast(SELECTIONS)
    return _write(ctx, "selections", audit, f"audit/{curation_id}/audit.parquet", curation_id)


def part_layout(rows_per_input: list[int], rows_per_shard: int) -> list[list[tuple[int, int, int]]]:
    """The embedded engine's cut of the curated rows (input shard after input shard) into curated
    shards of `rows_per_shard` rows: per output shard, its (input shard, first row, rows) slices."""
    parts, current, filled = [], [], 0
    for i, n in enumerate(rows_per_input):
        start = 0
        while start < n:
            take = min(n - start, rows_per_shard - filled)
            current.append((i, start, take))
            filled, start = filled + take, start + take
            if filled == rows_per_shard:
                parts.append(current)
                current, filled = [], 0
    if filled:
        parts.append(current)
    return parts


# ---- the client ------------------------------------------------------------------------------
@contextlib.contextmanager
def _client(scheduler):
    distributed = require_dask()
    if isinstance(scheduler, distributed.Client):
        yield scheduler
        return
    if not scheduler:
        raise ParamError("--engine dask needs --scheduler ADDRESS (a running `dask scheduler`) or local:N")
    text = str(scheduler)
    if text.startswith("local:"):
        try:
            n = int(text[len("local:"):])
        except ValueError:
            n = 0
        if n < 1:
            raise ParamError(f"--scheduler {text}: expected local:N with N >= 1 worker processes")
        with distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                      dashboard_address=":0") as cluster, distributed.Client(cluster) as client:
            yield client
        return
    try:
        client = distributed.Client(text, timeout="30s")
    except OSError as exc:
        raise CurationError(f"--scheduler {text}: cannot reach a Dask scheduler ({exc})") from None
    with client:
        yield client


def _versions() -> tuple[str, str]:
    import duckdb

    return duckdb.__version__, pa.__version__


def _stage_sql() -> dict[str, str]:
    folder = resources.files("queries")
    return {f.name[:-4]: f.read_text() for f in folder.iterdir() if f.name.startswith("curate_") and f.name.endswith(".sql")}


class _Run:
    """One distributed run: submits tasks, keeps every future so a failure can cancel them all."""

    def __init__(self, client, ctx: _Ctx, run: str):
        self.client, self.ctx, self.run = client, ctx, run
        self.futures: list = []
        self.n = 0

    def submit(self, fn, *args):
        self.n += 1
        future = self.client.submit(fn, *args, key=f"curate-{self.run}-{fn.__name__.strip('_')}-{self.n}")
        self.futures.append(future)
        return future

    def get(self, future, name: str):
        return self.submit(_get, future, name)

    def item(self, future, i: int):
        return self.submit(_item, future, i)

    def gather(self, futures):
        return self.client.gather(futures)

    def cancel(self) -> None:
        with contextlib.suppress(Exception):
            self.client.cancel(self.futures, force=True)


def curate_dask(
    buf: Buffer,
    recipe: Recipe,
    sets: dict[str, object] | None = None,
    snapshot_seq: int | None = None,
    commit: bool = True,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    threads: int | None = None,
    scheduler=None,
    partitions: int | None = None,
    _task_hooks: dict | None = None,
) -> CurationResult:
    """`curate.run.curate` on dask.distributed: the same curation id, curated shards and audit.

    `scheduler`: "local:N" (a LocalCluster of N one-thread worker processes), a scheduler address,
    or a `distributed.Client`. `partitions`: hash partitions of the batch (default: 2 per worker);
    `threads` and `memory_limit` apply to the DuckDB session of each task."""
    require_dask()
    params = resolve(recipe, dict(sets or {}))
    if recipe.sql is not None:
        raise ParamError("custom SQL recipes run on the embedded engine only (their SELECT may span groups): "
                         "drop --engine dask")
    if partitions is not None and partitions < 1:
        raise ParamError(f"partitions must be >= 1, got {partitions}")
    with buf.snapshot(snapshot_seq, pin=True) as snap, \
            Session(snap.verify(CURATION_INPUTS), memory_limit, threads) as session, \
            _client(scheduler) as client:
        client.wait_for_workers(1, timeout=120)
        versions = client.run(_versions)
        mine = _versions()
        for address, theirs in versions.items():
            if tuple(theirs) != mine:
                raise CurationError(f"Dask worker {address} runs duckdb/pyarrow {'/'.join(theirs)}, the client "
                                    f"{'/'.join(mine)}: every process must run the same versions")
        run = uuid.uuid4().hex[:12]
        folder = os.path.join("tmp", f"curate-{run}")
        ctx = _Ctx(snap.frozen(), params, {}, _stage_sql(), partitions or 2 * len(versions), memory_limit,
                   threads or 1, folder, READ_THREADS, dict(_task_hooks or {}))
        job = _Run(client, ctx, run)
        os.makedirs(os.path.join(buf.root, folder))
        try:
            return _curate(buf, snap, session, job, recipe, commit)
        except BaseException:
            job.cancel()
            raise
        finally:
            shutil.rmtree(os.path.join(buf.root, folder), ignore_errors=True)


def _resolve(job: _Run, session: Session, params: Params) -> Params:
    """The embedded engine's defaults for `where` and `current_version`, merged over shards."""
    n_shards = len(job.ctx.files.listing["rollouts"])
    values = dict(params.values)
    version = None
    if values["current_version"] is None:
        row = session.one("SELECT max(version) FROM checkpoints")
        version = None if row[0] is None else int(row[0])
    need_scan = values["where"] is None or (values["current_version"] is None and version is None)
    scans = job.gather([job.submit(_scan_defaults, job.ctx, i) for i in range(n_shards)]) if need_scan else []
    if values["where"] is None:
        rows = [tuple(row) for row, _ in scans if row is not None]
        if not rows:
            raise CurationError("empty batch: the snapshot has no rollouts")
        _, run_id, step = max(rows)
        values["where"] = f"run_id = {sql_string(run_id)} AND step = {int(step)}"
    if values["current_version"] is None:
        versions = [v for _, v in scans if v is not None]
        values["current_version"] = version if version is not None else (max(versions) if versions else None)
    return Params(values, params.user_set)


def _curate(buf: Buffer, snap, session: Session, job: _Run, recipe: Recipe, commit: bool) -> CurationResult:
    ctx = job.ctx
    params = _resolve(job, session, ctx.params)
    session.check_predicate(params["where"])
    sql_sha = texts_sha256(stage_texts(params, recipe))
    curation_id = curation_id_for(snap.seq, recipe.name, params.to_json(), sql_sha)
    if commit and already_committed(buf, curation_id):
        return _existing(buf, curation_id, snap.seq)
    p, q = params, stage_params(params)
    ctx = job.ctx = dataclasses.replace(ctx, params=params, q=q)
    n_shards, n_parts = len(ctx.files.listing["rollouts"]), ctx.partitions
    if n_shards == 0:
        raise CurationError(f"empty batch: no rollouts match where = {p['where']}")

    # Step 1 per input shard, shuffled to partitions by prompt; steps 2–7 per partition (with a
    # round trip for da3po's μ); the cross-group selection on the client.
    maps = [job.submit(_map_shard, ctx, i) for i in range(n_shards)]
    states = [job.submit(_partition_groups, ctx, *[job.item(m, j) for m in maps]) for j in range(n_parts)]
    stats = job.gather([job.get(st, "stats") for st in states])
    del maps
    if sum(s["n_candidates"] for s in stats) == 0:
        raise CurationError(f"empty batch: no rollouts match where = {p['where']}")
    if p["amplify"] == "da3po":
        mu = batch_mu(sum(s["k"] for s in stats), sum(s["n"] for s in stats))
        states = [job.submit(_partition_select, ctx, st, mu) for st in states]
    picked = None
    if p["sample"] == "cross_group":
        picked = _cross_group_pick(session, ctx, _concat(job.gather([job.get(st, "pool") for st in states])))

    # Every candidate's row in one task: the record's numbers and the per-shard decisions.
    collected = job.submit(_collect, ctx, picked, *states)
    del states
    summary = job.item(collected, "summary").result()
    decisions = [job.submit(_decision, collected, i) if n else None
                 for i, n in enumerate(summary["selected_per_shard"])]

    threshold = None
    if p["token"] != "none":
        threshold = _token_threshold(job, session, decisions, token_budget(summary["curated_tokens"], p.token_fraction()))
    mask_params = mask_parameters(p["token"], threshold)
    materialise_sql = _substitute(ctx.sql["curate_materialise"], {"score": _score_expr(p["token"], "h", "w.advantage_final")})

    layout = part_layout(summary["selected_per_shard"], curated_rows_per_shard(summary))
    written = [job.submit(_materialise_part, ctx, curation_id, f"part-{k:05d}", slices, mask_params, materialise_sql,
                          *[decisions[i] for i, _, _ in slices])
               for k, slices in enumerate(layout)]
    audit_future = job.submit(_write_audit, ctx, curation_id, collected, *written)
    parts: list[_Written] = job.gather(written)
    audit_part: WrittenPart = audit_future.result()

    record = new_record(curation_id, snap.seq, recipe, params, sql_sha, summary, summary["sample_budget"], threshold)
    record["tokens_kept"] = int(sum(pc.sum(w.kept.column("tokens_kept")).as_py() or 0 for w in parts))
    record["old_logprobs_fallback"] = sum(w.fallback for w in parts)
    output_files = [w.part.relpath for w in parts] + [audit_part.relpath]
    record["output_files"] = json.dumps(output_files)
    out = CurationResult(curation_id, record, summary["reasons"], snap.seq, committed=False,
                         output_files=output_files)
    out.audit = pq.read_table(os.path.join(buf.root, audit_part.tmp_relpath)).cast(SELECTIONS)
    if not commit:
        curated = [pq.read_table(os.path.join(buf.root, w.part.tmp_relpath)) for w in parts]
        out.curated = pa.concat_tables(curated).cast(CURATED) if curated else CURATED.empty_table()
        return out
    record_part = Part("curations", pa.Table.from_pylist([record], schema=CURATIONS), curation_id)
    return publish(buf, lambda: [w.part for w in parts] + [audit_part, record_part], curation_id, out)


def _decision(collected: dict, i: int) -> pa.Table:
    return collected["decisions"][i]


def _cross_group_pick(session: Session, ctx: _Ctx, pool: pa.Table) -> pa.Table:
    """Steps 6–7 over the whole batch's pool, with the same select SQL: `picked` plus `part`."""
    _load(session, "work", pool.sort_by("rollout_id"))
    _Stages(session, ctx.sql).run("curate_select", ctx.q, pool_key="'batch'", value="advantage_final")
    return _read(session, "SELECT p.*, w.part FROM picked p JOIN work w USING (rollout_id)")


def _token_threshold(job: _Run, session: Session, decisions: list, k: int):
    """The K-th token over all shards: summed histograms pick the bucket and the offset in it; the
    first offset+1 tokens of that bucket from each shard hold the K-th one."""
    shards = [i for i, d in enumerate(decisions) if d is not None]
    results = job.gather([job.submit(_token_histogram, job.ctx, i, decisions[i]) for i in shards])
    missing = sorted(m for m, _ in results if m is not None)
    if missing:
        raise missing_entropies_error(missing[0], job.ctx.params["token"])
    merged: dict[int, int] = {}
    for _, hist in results:
        for bucket, n in hist:
            merged[bucket] = merged.get(bucket, 0) + n
    found = pick_bucket(sorted(merged.items(), reverse=True), k)
    if found is None:
        return None
    bucket, offset = found
    holders = [i for i, (_, hist) in zip(shards, results) if any(b == bucket for b, _ in hist)]
    heads = job.gather([job.submit(_token_head, job.ctx, i, decisions[i], bucket, offset + 1) for i in holders])
    _load(session, "token_heads", _concat(heads))
    row = session.one(f"SELECT score, rollout_id, pos FROM token_heads {TOKEN_ORDER} LIMIT 1 OFFSET $o",
                      {"o": offset})
    return float(row[0]), str(row[1]), int(row[2])


def _existing(buf: Buffer, curation_id: str, snapshot_seq: int) -> CurationResult:
    """The committed curation with this id (run earlier, by either engine): nothing is recomputed."""
    with buf.snapshot(pin=True) as snap, Session(snap) as s:
        record = _read(s, "SELECT * FROM curations WHERE curation_id = $c", {"c": curation_id}).to_pylist()[0]
        audit = _read(s, "SELECT * FROM selections WHERE curation_id = $c ORDER BY rollout_id",
                      {"c": curation_id}).cast(SELECTIONS)
    reasons = {}
    for reason in audit.column("reason").to_pylist():
        reasons[reason] = reasons.get(reason, 0) + 1
    return CurationResult(curation_id, record, dict(sorted(reasons.items())), snapshot_seq, committed=True,
                          already_existed=True, audit=audit, output_files=json.loads(record["output_files"]))
