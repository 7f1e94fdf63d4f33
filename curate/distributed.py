"""Curation on dask.distributed: the embedded engine's plan, SQL and bytes.

Invariants:
- The client builds the plan (`curate.plan`) and ships it with every task: workers run the
  client's SQL text, step by step, in the plan's order. This module adds only the merges of the
  GLOBAL steps and the placement of the others:
  - ROW steps of the candidates phase and PROMPT steps (the difficulty history) run per input
    shard; their rows go to partition md5(prompt_id) mod P, so a partition holds whole prompts,
    hence whole groups (a group's rows share one prompt, checked at append) and the whole history
    of its prompts (per-prompt counts add up exactly);
  - GROUP and ROW steps then run inside each partition until a GLOBAL step, whose merge is exact:
    μ from integer counts (`curate.steps.mu_of`); the cross-group max-variance subset by the same
    select step over every pool row, run on the client, its `picked` rows sent back by partition;
  - the record's steps and the audit run over every candidate's narrow row in one task;
  - token steps run per input shard holding a selected row: the entropies are read once and kept
    (as the worker's Arrow table) for the threshold's second pass, the kept counts and the
    materialisation; the threshold merges summed histograms, then the bucket's heads
    (`curate.tokens`);
  - curated shards are cut exactly as the embedded engine cuts them (`output.part_layout`), one
    task per output shard, with the client's row-group sizing, so the worker's host does not
    change the bytes; workers write them, and the audit, only under BUFFER/tmp/curate-<host>-<pid>-<hex>/
    (named for the client: gc keeps it while the client lives).
- Nothing is visible until the client links every file into place and commits them with the
  record in ONE `Buffer.commit`. On any failure (a lost worker past Dask's retries, an interrupt,
  an error) the run folder is removed and nothing is committed. Tasks are pure functions of their
  inputs, so a task that Dask reruns after losing a worker gives the same rows and bytes.
- The curation id is the plan's (`Plan.curation_id`): a curation run on either engine is
  idempotent with the other.
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

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from queries.session import DEFAULT_MEMORY_LIMIT, Session
from storage.buffer import Buffer, Part, WrittenPart, token_count
from storage.owners import owned_name
from storage.schema import CURATED, CURATIONS, SELECTIONS, TABLES
from storage.shardio import READ_THREADS, write_tmp
from storage.snapshot import SnapshotFiles, sql_string

from .output import (
    CurationResult,
    already_committed,
    audit_path,
    curated_table,
    new_record,
    part_layout,
    part_name,
    publish,
    rows_per_shard,
    sorted_by_rollout,
    summarise,
)
from .params import CurationError, ParamError, Params, Recipe, resolve, token_budget
from .plan import GLOBAL, PROMPT, Plan, Step, build
from .steps import (
    CURATION_INPUTS,
    Runner,
    latest_checkpoint,
    latest_policy,
    latest_step,
    mu_of,
    parquet,
    with_defaults,
)
from .tokens import check_exact, mask_values, merge_histograms, missing_entropies_error, pick_bucket, threshold_of

NO_SELECTIONS = ("(SELECT NULL::VARCHAR AS rollout_id, NULL::VARCHAR AS curation_id, "
                 "NULL::BOOLEAN AS selected WHERE false)")
HISTORY_MERGE = ("SELECT prompt_id, sum(n)::BIGINT AS n, sum(k)::BIGINT AS k "
                 "FROM history_parts GROUP BY prompt_id")
DECISIONS = ("SELECT shard, rollout_id, selected, advantage_final, weight, tokens_total FROM work "
             "WHERE selected ORDER BY shard, rollout_id")
POOL = "SELECT rollout_id, reason, advantage_final, part FROM work WHERE reason IS NULL"
SELECTION_PHASES = ("groups", "difficulty", "amplify", "select", "apply")


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
    plan: Plan  # the client's plan: every step's SQL text travels with it
    values: dict  # the $values of the run so far (μ joins them after its merge)
    partitions: int
    memory_limit: str
    threads: int
    folder: str  # tmp/curate-<run>, relative to the buffer root
    write_threads: int  # the client's READ_THREADS: row groups as the embedded engine would cut them
    hooks: dict = field(default_factory=dict)  # tests: {task kind: seconds to sleep first, or "fail"}

    def shard(self, i: int) -> str:
        return self.files.listing["rollouts"][i]

    def step(self, sql: str) -> Step:
        return self.plan.step(sql)


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
        self.spill_dir = os.path.join(self.root, "tmp", owned_name("duckdb"))
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
    values: dict = field(default_factory=dict)
    stop: int | None = None  # index of the GLOBAL step the partition waits at (None: done)
    partial: object = None  # its share of that step's input


@dataclass
class _Written:
    part: WrittenPart
    fallback: int = 0


def _get(obj, name: str):
    return getattr(obj, name)


def _item(obj, i: int):
    return obj[i]


# ---- tasks ------------------------------------------------------------------------------------
def _scan_defaults(ctx: _Ctx, i: int):
    """The latest (created_at, run_id, step) and the max policy_version of one input shard."""
    _start(ctx, "scan")
    source = parquet([ctx.shard(i)])
    with _session(ctx) as s:
        return latest_step(s, source), latest_policy(s, source)


def _map_shard(ctx: _Ctx, i: int) -> list[tuple[pa.Table, pa.Table | None]]:
    """The candidates phase (ROW steps) and the PROMPT steps over one input shard, split by
    partition. The `where` predicate sees the whole snapshot, as in the embedded engine."""
    _start(ctx, "map")
    source = parquet([ctx.shard(i)], located=True)
    part = f"(md5_number(prompt_id) % {ctx.partitions})::INTEGER"
    with _session(ctx, whole=True) as s:
        runner = Runner(s, dict(ctx.values))
        for step in ctx.plan.phase("candidates"):
            bound = {"rollouts": source}
            if "selections" in step.relations and ctx.values["max_reuse"] is None:
                bound["selections"] = NO_SELECTIONS
            runner.run(step, {k: v for k, v in bound.items() if k in step.relations})
        work = _read(s, f"SELECT *, {int(i)}::INTEGER AS shard, {part} AS part FROM work")
        history = None
        for step in ctx.plan.steps:
            if step.scope == PROMPT:
                runner.run(step, {"rows": parquet([ctx.shard(i)])})
                history = _read(s, f"SELECT *, {part} AS part FROM prompt_history")
    return list(zip(_split(work, "part", ctx.partitions), _split(history, "part", ctx.partitions)))


def _partition_start(ctx: _Ctx, *pieces) -> _State:
    """A partition's rows (and its prompts' merged history), then its selection steps."""
    _start(ctx, "groups")
    with _session(ctx) as s:
        _load(s, "work", _concat([w for w, _ in pieces]))
        history = [h for _, h in pieces if h is not None]
        if history:
            _load(s, "history_parts", _concat(history))
            _load(s, "prompt_history", _read(s, HISTORY_MERGE))
        return _advance(ctx, s, _first_selection_step(ctx.plan), dict(ctx.values))


def _partition_resume(ctx: _Ctx, state: _State, merged: dict, picked: pa.Table | None) -> _State:
    """A partition after the client merged the GLOBAL step it waited at."""
    _start(ctx, "select")
    with _session(ctx) as s:
        _load(s, "work", state.work)
        if state.history is not None:
            _load(s, "prompt_history", state.history)
        if picked is not None:
            _load(s, "picked", picked)
        return _advance(ctx, s, state.stop + 1, {**state.values, **merged})


def _first_selection_step(plan: Plan) -> int:
    return next(i for i, s in enumerate(plan.steps) if s.phase in SELECTION_PHASES)


def _advance(ctx: _Ctx, s: Session, start: int, values: dict) -> _State:
    """Run the selection steps from `start` until a GLOBAL one (returning its partial input) or the end."""
    runner = Runner(s, values)
    history = _read(s, "SELECT * FROM prompt_history") if _has(s, "prompt_history") else None
    for idx in range(start, len(ctx.plan.steps)):
        step = ctx.plan.steps[idx]
        if step.phase not in SELECTION_PHASES or step.scope == PROMPT:
            continue
        if step.scope == GLOBAL:
            partial = runner.rows(step) if step.merge == "mu" else _read(s, POOL)
            return _State(_read(s, "SELECT * FROM work"), history, values, idx, partial)
        runner.run(step)
    return _State(_read(s, "SELECT * FROM work"), None, values)


def _has(s: Session, name: str) -> bool:
    return bool(s.one("SELECT count(*) FROM duckdb_tables() WHERE table_name = $n", {"n": name})[0])


def _collect(ctx: _Ctx, *states: _State) -> dict:
    """Every candidate's final narrow row in one task: the record's numbers, and per input shard
    the decisions (selected rows, their advantage and weight) that the token steps need."""
    _start(ctx, "collect")
    n_shards = len(ctx.files.listing["rollouts"])
    with _session(ctx) as s:
        _load(s, "work", _concat([st.work for st in states]))
        runner = Runner(s, dict(ctx.values))
        summary = summarise(runner, ctx.plan)
        summary["sample_budget"] = (s.one("SELECT count(*) FROM work WHERE selected")[0]
                                    if ctx.plan.counts_budget else None)
        decisions = _split(_read(s, DECISIONS), "shard", n_shards)
        summary["selected_per_shard"] = [t.num_rows for t in decisions]
        work = _read(s, "SELECT * FROM work")
    return {"work": work, "summary": summary,
            "decisions": [t.drop_columns(["shard"]) if t.num_rows else None for t in decisions]}


def _decision(collected: dict, i: int) -> pa.Table:
    return collected["decisions"][i]


def _entropies(ctx: _Ctx, i: int, decisions: pa.Table) -> dict:
    """One shard's token steps, pass 1: its selected rows' entropies (read once, returned for the
    later steps), the first one missing, and the score histogram."""
    _start(ctx, "tokens")
    with _session(ctx) as s:
        _load(s, "work", decisions)
        runner = Runner(s, dict(ctx.values))
        runner.run(ctx.step("curate_token_entropies"), {"rollouts": parquet([ctx.shard(i)])})
        missing = runner.rows(ctx.step("curate_missing_entropies"))
        if missing:
            return {"missing": missing[0][0], "hist": [], "table": None}
        runner.run(ctx.step("curate_token_scores"))
        hist = [(int(b), int(n)) for b, n in runner.rows(ctx.step("curate_token_histogram"))]
        return {"missing": None, "hist": hist, "table": _read(s, "SELECT * FROM selected_entropies")}


def _token_head(ctx: _Ctx, scored: dict, bucket: int, n: int) -> pa.Table:
    """The first `n` tokens of one bucket of one shard, from its kept entropies (no Parquet read)."""
    _start(ctx, "tokens")
    with _session(ctx) as s:
        _load(s, "selected_entropies", scored["table"])
        runner = Runner(s, dict(ctx.values))
        runner.run(ctx.step("curate_token_scores"))
        return runner.table(ctx.step("curate_token_bucket"), bucket=bucket, n=n)


def _task_runner(ctx: _Ctx, s: Session, decisions: pa.Table, scored: dict | None, values: dict) -> Runner:
    """A session holding one shard's decisions as `work` and its selected entropies."""
    _load(s, "work", decisions)
    runner = Runner(s, {**ctx.values, **values})
    if scored is None:
        runner.run(ctx.step("curate_no_entropies"))
    else:
        _load(s, "selected_entropies", scored["table"])
    return runner


def _kept(ctx: _Ctx, decisions: pa.Table, scored: dict | None, values: dict) -> pa.Table:
    """Tokens kept per selected row of one shard."""
    _start(ctx, "kept")
    with _session(ctx) as s:
        runner = _task_runner(ctx, s, decisions, scored, values)
        runner.run(ctx.step("curate_tokens_kept"))
        return _read(s, "SELECT * FROM kept_counts")


def _write(ctx: _Ctx, table_name: str, table: pa.Table, relpath: str, key: str) -> WrittenPart:
    schema = TABLES[table_name]
    table = table.select(schema.names).cast(schema)  # exactly what Buffer.commit writes for a Part
    tmp, nbytes, sha = write_tmp(table, ctx.files.root, ctx.folder, ctx.write_threads)
    return WrittenPart(table_name, tmp, relpath, table.num_rows, token_count(table), nbytes, sha, key)


def _materialise_part(ctx: _Ctx, curation_id: str, k: int, slices: list, values: dict, *inputs) -> _Written:
    """One curated shard: slices (shard, start, rows) of materialised input shards, written to tmp."""
    _start(ctx, "materialise")
    pieces = []
    for (i, start, rows), (decisions, scored) in zip(slices, zip(inputs[::2], inputs[1::2])):
        with _session(ctx) as s:
            runner = _task_runner(ctx, s, decisions, scored, values)
            table = runner.table(ctx.step("curate_materialise"), {"rollouts": parquet([ctx.shard(i)])})
            pieces.append(sorted_by_rollout(table).slice(start, rows))
    table, fallback = curated_table(pieces, curation_id)
    name, path = part_name(curation_id, k)
    return _Written(_write(ctx, "curated", table, path, curation_id), fallback)


def _write_audit(ctx: _Ctx, curation_id: str, collected: dict, *kept: pa.Table) -> WrittenPart:
    """The audit: one row per candidate, in rollout_id order, written to tmp."""
    _start(ctx, "audit")
    with _session(ctx) as s:
        _load(s, "work", collected["work"])
        _load(s, "kept_counts", _concat(list(kept)) if kept else pa.table(
            {"rollout_id": pa.array([], pa.string()), "tokens_kept": pa.array([], pa.int32())}))
        audit = Runner(s, {"curation_id": curation_id}).table(ctx.step("curate_audit")).cast(SELECTIONS)
    return _write(ctx, "selections", audit, audit_path(curation_id), curation_id)


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
    dry_run: bool = False,
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
        folder = os.path.join("tmp", owned_name("curate"))  # gc keeps it while this client lives
        ctx = _Ctx(snap.frozen(), build(params, recipe), {}, partitions or 2 * len(versions), memory_limit,
                   threads or 1, folder, READ_THREADS, dict(_task_hooks or {}))
        job = _Run(client, ctx, run)
        os.makedirs(os.path.join(buf.root, folder))
        try:
            return _curate(buf, snap, session, job, recipe, params, commit, dry_run)
        except BaseException:
            job.cancel()
            raise
        finally:
            shutil.rmtree(os.path.join(buf.root, folder), ignore_errors=True)


def _resolve(job: _Run, session: Session, params: Params) -> Params:
    """The embedded engine's defaults for `where` and `current_version`, merged over shards."""
    n_shards = len(job.ctx.files.listing["rollouts"])
    version = latest_checkpoint(session) if params["current_version"] is None else None
    need_scan = params["where"] is None or (params["current_version"] is None and version is None)
    scans = job.gather([job.submit(_scan_defaults, job.ctx, i) for i in range(n_shards)]) if need_scan else []
    latest = max((tuple(row) for row, _ in scans if row is not None), default=None)
    versions = [v for _, v in scans if v is not None]
    if version is None and versions:
        version = max(versions)
    return with_defaults(params, latest, version)


def _curate(buf: Buffer, snap, session: Session, job: _Run, recipe: Recipe, params: Params, commit: bool,
            dry_run: bool) -> CurationResult:
    params = _resolve(job, session, params)
    session.check_predicate(params["where"])
    plan = build(params, recipe)
    curation_id = plan.curation_id(snap.seq)
    if commit and not dry_run and already_committed(buf, curation_id):
        return _existing(buf, curation_id, snap.seq)
    ctx = job.ctx = dataclasses.replace(job.ctx, plan=plan, values=dict(plan.values))
    n_shards, n_parts = len(ctx.files.listing["rollouts"]), ctx.partitions
    if n_shards == 0:
        raise CurationError(f"empty batch: no rollouts match where = {params['where']}")

    # Candidates per input shard, shuffled to partitions by prompt; the selection steps per
    # partition, with a round trip to the client at each GLOBAL step.
    maps = [job.submit(_map_shard, ctx, i) for i in range(n_shards)]
    states = [job.submit(_partition_start, ctx, *[job.item(m, j) for m in maps]) for j in range(n_parts)]
    del maps
    if sum(job.gather([job.submit(_rows, st) for st in states])) == 0:
        raise CurationError(f"empty batch: no rollouts match where = {params['where']}")
    while True:
        stop = job.gather([job.get(st, "stop") for st in states])[0]
        if stop is None:
            break
        step, partials = plan.steps[stop], job.gather([job.get(st, "partial") for st in states])
        if step.merge == "mu":
            mu = mu_of([row for rows in partials for row in rows])
            states = [job.submit(_partition_resume, ctx, st, {"mu": mu}, None) for st in states]
        else:  # "pool": the select step over the whole batch's pool, on the client
            picked = _pick(session, ctx, step, _concat(partials))
            states = [job.submit(_partition_resume, ctx, st, {}, part) for st, part in
                      zip(states, _split(picked, "part", n_parts))]

    # Every candidate's row in one task: the record's numbers and the per-shard decisions.
    collected = job.submit(_collect, ctx, *states)
    del states
    summary = job.item(collected, "summary").result()
    decisions = [job.submit(_decision, collected, i) if n else None
                 for i, n in enumerate(summary["selected_per_shard"])]
    scored = [None] * n_shards
    threshold, k = None, None
    if plan.token_stage:
        scored = [job.submit(_entropies, ctx, i, d) if d is not None else None for i, d in enumerate(decisions)]
        k = token_budget(summary["tokens_selected"], params.token_fraction())
        threshold = _token_threshold(job, scored, k)
    values = mask_values(threshold)
    shards = [i for i, d in enumerate(decisions) if d is not None]
    kept = [job.submit(_kept, ctx, decisions[i], scored[i], values) for i in shards]
    tokens_kept = sum(int(pc.sum(t.column("tokens_kept")).as_py() or 0) for t in job.gather(kept))
    if k is not None:
        check_exact(k, tokens_kept)
    audit_future = job.submit(_write_audit, ctx, curation_id, collected, *kept)
    record = new_record(plan, curation_id, snap.seq, summary, summary["sample_budget"], threshold, tokens_kept)
    audit_part: WrittenPart = audit_future.result()
    audit = pq.read_table(os.path.join(buf.root, audit_part.tmp_relpath)).cast(SELECTIONS)
    out = CurationResult(curation_id, record, summary["reasons"], snap.seq, committed=False, audit=audit)
    if dry_run:
        return out

    layout = part_layout(summary["selected_per_shard"], rows_per_shard(summary))
    written = [job.submit(_materialise_part, ctx, curation_id, k, slices, values,
                          *[x for i, _, _ in slices for x in (decisions[i], scored[i])])
               for k, slices in enumerate(layout)]
    parts: list[_Written] = job.gather(written)
    record["old_logprobs_fallback"] = sum(w.fallback for w in parts)
    out.output_files = [w.part.relpath for w in parts] + [audit_part.relpath]
    record["output_files"] = json.dumps(out.output_files)
    if not commit:
        curated = [pq.read_table(os.path.join(buf.root, w.part.tmp_relpath)) for w in parts]
        out.curated = pa.concat_tables(curated).cast(CURATED) if curated else CURATED.empty_table()
        return out
    record_part = Part("curations", pa.Table.from_pylist([record], schema=CURATIONS), curation_id)
    return publish(buf, lambda: [w.part for w in parts] + [audit_part, record_part], curation_id, out)


def _rows(state: _State) -> int:
    return state.work.num_rows


def _pick(session: Session, ctx: _Ctx, step: Step, pool: pa.Table) -> pa.Table:
    """The merge of a pooled GLOBAL step: the same step over every partition's pool rows, on the
    client; its `picked` rows with their partition."""
    _load(session, "work", pool.sort_by("rollout_id"))
    Runner(session, dict(ctx.values)).run(step)
    return _read(session, "SELECT p.*, w.part FROM picked p JOIN work w USING (rollout_id)")


def _token_threshold(job: _Run, scored: list, k: int):
    """The K-th token over all shards: summed histograms pick the bucket and the offset in it; the
    first offset+1 tokens of that bucket from each shard hold the K-th one."""
    shards = [i for i, f in enumerate(scored) if f is not None]
    results = job.gather([job.submit(_get_fields, scored[i]) for i in shards])
    missing = sorted(r["missing"] for r in results if r["missing"] is not None)
    if missing:
        raise missing_entropies_error(missing[0], job.ctx.plan.params["token"])
    found = pick_bucket(merge_histograms([r["hist"] for r in results]), k)
    if found is None:
        return None
    bucket, offset = found
    holders = [i for i, r in zip(shards, results) if any(b == bucket for b, _ in r["hist"])]
    heads = job.gather([job.submit(_token_head, job.ctx, scored[i], bucket, offset + 1) for i in holders])
    return threshold_of(heads, offset)


def _get_fields(scored: dict) -> dict:
    """A shard's token pass-1 result without its entropies table (that stays on the worker)."""
    return {"missing": scored["missing"], "hist": scored["hist"]}


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
