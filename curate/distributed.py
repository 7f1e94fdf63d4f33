"""Curation on dask.distributed: the embedded engine's plan, SQL and bytes.

Invariants:
- The client builds the plan (`curate.plan`) and ships it with every task: workers run the
  client's SQL text, step by step, in the plan's order; no SQL of this module runs on the batch.
  What this module adds is the placement of the steps and the gathering of a GLOBAL step's
  partial results for its registered merge (`curate.merges`, the same merge the embedded engine
  uses):
  - the candidates phase's ROW steps and the PROMPT steps that read Parquet (the difficulty
    history) run per input shard; their rows go to partition hash(prompt_id) mod P, so a partition
    holds whole prompts, hence whole groups (a group's rows share one prompt, checked at append)
    and every part of its prompts' history (per-prompt counts add up exactly);
  - the other steps of the candidates and selection phases run inside each partition until a
    GLOBAL step: its partial results go through its merge on the client (μ, the batch size, one
    run), or, for a `whole` step (the cross-group selection, the replay choice), the step runs on
    the client over every partition's `work` and the tables it writes go back to every partition;
  - the record's steps run over every candidate's narrow row in one task; so does the audit;
  - token and output steps run per input shard holding a selected row, with the same round trips
    at their GLOBAL steps (first missing entropies, histogram, bucket heads, kept total); a shard's
    tables (its selected rows, their entropies, kept counts) travel as Arrow between its tasks,
    and a task re-declares the views of earlier steps (`_views_before`);
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

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from queries.session import DEFAULT_MEMORY_LIMIT, Session
from storage.buffer import Buffer, Part, WrittenPart, token_count
from storage.owners import owned_name
from storage.schema import CURATED_REFS, CURATIONS, SELECTIONS, TABLES
from storage.shardio import READ_THREADS, write_tmp
from storage.snapshot import SnapshotFiles

from .output import (
    CurationResult,
    already_committed,
    audit_path,
    curated_table,
    new_record,
    part_layout,
    part_name,
    publish,
    referenced_paths,
    rows_per_shard,
    sorted_by_rollout,
    summarise,
    token_values,
)
from .merges import MERGES
from .params import CurationError, ParamError, Params, Recipe, resolve
from .plan import GLOBAL, PROMPT, ROW, SELECTION_PHASES, Plan, Step, build
from .steps import (
    CURATION_INPUTS,
    Runner,
    latest_checkpoint,
    latest_policy,
    latest_step,
    parquet,
    run_values,
    with_defaults,
)

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


def _start(ctx: _Ctx, kind: str) -> None:
    hook = ctx.hooks.get(kind)
    if hook == "fail":
        raise RuntimeError(f"test hook: {kind} task failed")
    if hook:
        time.sleep(hook)


def _session(ctx: _Ctx, shard: str | None = None, whole: bool = False) -> Session:
    """A sandboxed DuckDB session for a task: over the whole snapshot (`whole`), one input shard
    as `rollouts`, or nothing but what the task loads."""
    if whole:
        return Session(ctx.files, ctx.memory_limit, ctx.threads)
    return Session(None, ctx.memory_limit, ctx.threads, root=ctx.files.root, rollouts=shard)


def _split(table: pa.Table | None, column: str, n: int) -> list[pa.Table | None]:
    if table is None:
        return [None] * n
    return [table.filter(pc.equal(table.column(column), i)) for i in range(n)]


def _concat(tables: list[pa.Table]) -> pa.Table:
    return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]


def _views_before(plan: Plan, start: int, phases: tuple[str, ...]) -> list[Step]:
    """The view steps of `phases` before `start`: a view is a definition, not data, so a task that
    resumes a part re-declares the views its earlier steps made (the tables travel as Arrow)."""
    return [s for s in plan.steps[:start] if s.phase in phases and s.scope != GLOBAL and " TEMP VIEW " in s.text]


@contextlib.contextmanager
def _resumed(ctx: _Ctx, tables: dict[str, pa.Table], start: int, values: dict, phases: tuple[str, ...]):
    """A task's session over a part's tables, with the views of its earlier steps re-declared."""
    with _session(ctx) as s:
        for name, table in tables.items():
            s.load(name, table)
        runner = Runner(s, values)
        for view in _views_before(ctx.plan, start, phases):
            runner.run(view)
        yield s, runner


@dataclass
class _State:
    """A part between two GLOBAL steps: its tables (narrow `work` rows, its prompts' history, a
    shard's selected entropies and kept counts), the GLOBAL step it waits at, its partial result."""

    tables: dict[str, pa.Table]
    stop: int | None = None  # index of the GLOBAL step the part waits at (None: done)
    partial: object = None  # its share of that step's result (None for a `whole` step)


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
    """The steps that read Parquet before the selection, over one input shard: the candidates
    phase's ROW steps and the PROMPT steps that read history rows; their rows split by partition.
    The `where` predicate sees the whole snapshot, as in the embedded engine."""
    _start(ctx, "map")
    with _session(ctx, whole=True) as s:
        runner = Runner(s, dict(ctx.values))
        history = None
        for step in ctx.plan.steps:
            if step.phase == "candidates" and step.scope == ROW:
                runner.run(step, {"rollouts": parquet([ctx.shard(i)], located=True)} if step.relations else None)
            elif step.scope == PROMPT and step.relations:
                runner.run(step, {"rows": parquet([ctx.shard(i)])})
                history = _tag(s.unload(step.writes[0]), None, ctx.partitions)
        work = _tag(s.unload("work"), i, ctx.partitions)
    return list(zip(_split(work, "part", ctx.partitions), _split(history, "part", ctx.partitions)))


def _tag(table: pa.Table, shard: int | None, partitions: int) -> pa.Table:
    """`table` with its partition (a fixed 64-bit hash of prompt_id mod P) and input shard."""
    import numpy as np
    import pandas as pd

    ids = np.array(table.column("prompt_id").to_pylist(), dtype=object)
    parts = (pd.util.hash_array(ids, categorize=False) % np.uint64(partitions)).astype(np.int32)
    table = table.append_column("part", pa.array(parts, pa.int32()))
    if shard is not None:
        table = table.append_column("shard", pa.array([shard] * table.num_rows, pa.int32()))
    return table


def _partition_start(ctx: _Ctx, *pieces) -> _State:
    """A partition's rows (and its prompts' history parts), then the steps up to a GLOBAL one."""
    _start(ctx, "groups")
    tables = {"work": _concat([w for w, _ in pieces])}
    history = [h for _, h in pieces if h is not None]
    if history:
        tables["history_parts"] = _concat(history)
    return _advance(ctx, _State(tables), 0, dict(ctx.values), {})


def _advance(ctx: _Ctx, state: _State, start: int, values: dict, shipped: dict[str, pa.Table]) -> _State:
    """A partition from step `start`: the steps of the candidates and selection phases that were
    not run per shard, until a GLOBAL one (returning its partial result) or the end."""
    phases = ("candidates", *SELECTION_PHASES)
    with _resumed(ctx, {**state.tables, **shipped}, start, values, phases) as (s, runner):
        for idx in range(start, len(ctx.plan.steps)):
            step = ctx.plan.steps[idx]
            if step.phase not in phases or (step.scope == ROW and step.phase == "candidates") or \
                    (step.scope == PROMPT and step.relations):
                continue
            if step.scope == GLOBAL:
                merge = MERGES[step.merge]
                partial = runner.partial(step, merge.arrow) if merge.combine is not None else None
                return _State(_tables(s), idx, partial)
            runner.run(step)
        return _State(_tables(s))


def _tables(s: Session) -> dict[str, pa.Table]:
    """Every temp table of a task's session, as Arrow (views stay definitions)."""
    return {name: s.unload(name) for name in s.temp_tables()}


def _collect(ctx: _Ctx, *states: _State) -> dict:
    """Every candidate's final narrow row in one task: the record steps (`whole`), and per input
    shard the selected rows that the token and output steps need."""
    _start(ctx, "collect")
    n_shards = len(ctx.files.listing["rollouts"])
    work = _concat([st.tables["work"] for st in states])
    with _session(ctx) as s:
        s.load("work", work)
        runner = Runner(s, dict(ctx.values))
        results = {step.result: runner.table(step) for step in ctx.plan.phase("record")}
    summary = summarise(results)
    selected = work.filter(pc.fill_null(work.column("selected"), False)).sort_by([("shard", "ascending"),
                                                                                ("rollout_id", "ascending")])
    decisions = _split(selected, "shard", n_shards)
    summary["selected_per_shard"] = [t.num_rows for t in decisions]
    return {"work": work, "summary": summary,
            "decisions": [t if t.num_rows else None for t in decisions]}


def _decision(collected: dict, i: int) -> pa.Table:
    return collected["decisions"][i]


def _shard_advance(ctx: _Ctx, i: int, state: _State, start: int, values: dict) -> _State:
    """One input shard's token and output steps from step `start` (its selected rows as `work`,
    its tables so far), until a GLOBAL step (returning its partial result) or the output's end."""
    _start(ctx, "tokens")
    phases = ("tokens", "output")
    with _resumed(ctx, state.tables, start, values, phases) as (s, runner):
        for idx in range(start, len(ctx.plan.steps)):
            step = ctx.plan.steps[idx]
            if step.phase not in phases:
                continue
            if step.scope == GLOBAL:
                merge = MERGES[step.merge]
                if merge.combine is None:  # the audit: over every candidate's row (`_audit`)
                    break
                if not merge.runs(values):
                    continue
                return _State(_tables(s), idx, runner.partial(step, merge.arrow))
            runner.run(step, {"rollouts": parquet([ctx.shard(i)])} if step.relations else None)
        return _State(_tables(s))


def _write(ctx: _Ctx, table_name: str, table: pa.Table, relpath: str, key: str) -> WrittenPart:
    schema = TABLES[table_name]
    table = table.select(schema.names).cast(schema)  # exactly what Buffer.commit writes for a Part
    tmp, nbytes, sha = write_tmp(table, ctx.files.root, ctx.folder, ctx.write_threads)
    return WrittenPart(table_name, tmp, relpath, table.num_rows, token_count(table), nbytes, sha, key)


def _materialise_part(ctx: _Ctx, curation_id: str, k: int, slices: list, values: dict, *states: _State) -> _Written:
    """One curated shard: slices (shard, start, rows) of materialised input shards, written to tmp."""
    _start(ctx, "materialise")
    step = ctx.plan.phase("materialise")[0]
    pieces = []
    for (i, start, rows), state in zip(slices, states):
        with _session(ctx) as s:
            for name, table in state.tables.items():
                s.load(name, table)
            table = Runner(s, values).table(step, {"rollouts": parquet([ctx.shard(i)], numbered=True)})
            pieces.append(sorted_by_rollout(table).slice(start, rows))
    table, fallback = curated_table(pieces, curation_id, ctx.files.root)
    name, path = part_name(curation_id, k)
    return _Written(_write(ctx, "curated", table, path, curation_id), fallback)


def _whole(ctx: _Ctx, idx: int, values: dict, tables: dict[str, pa.Table]) -> pa.Table:
    """A `whole` step of the output phase in one task, over every part's tables concatenated."""
    _start(ctx, "audit")
    with _session(ctx) as s:
        for name, table in tables.items():
            s.load(name, table)
        return Runner(s, values).table(ctx.plan.steps[idx])


def _write_audit(ctx: _Ctx, curation_id: str, audit: pa.Table) -> WrittenPart:
    return _write(ctx, "selections", audit.cast(SELECTIONS), audit_path(curation_id), curation_id)


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
    values = {**run_values(plan), "curation_id": curation_id}
    ctx = job.ctx = dataclasses.replace(job.ctx, plan=plan, values=dict(values))
    n_shards, n_parts = len(ctx.files.listing["rollouts"]), ctx.partitions
    if n_shards == 0:
        raise CurationError(f"empty batch: no rollouts match where = {params['where']}")

    # Candidates per input shard, shuffled to partitions by prompt; the selection steps per
    # partition, with a round trip to the client at each GLOBAL step (its registered merge).
    maps = [job.submit(_map_shard, ctx, i) for i in range(n_shards)]
    states = [job.submit(_partition_start, ctx, *[job.item(m, j) for m in maps]) for j in range(n_parts)]
    del maps
    states = _merge_rounds(job, session, states, values, _partition_resume)

    # Every candidate's row in one task: the record's numbers and the per-shard decisions.
    collected = job.submit(_collect, ctx, *states)
    del states
    summary = job.item(collected, "summary").result()
    values.update(token_values(plan, summary))
    shards = [i for i, n in enumerate(summary["selected_per_shard"]) if n]
    first = next(i for i, s in enumerate(plan.steps) if s.phase == "tokens")
    per_shard = {i: job.submit(_shard_advance, ctx, i, job.submit(_shard_state, collected, i), first, dict(values))
                 for i in shards}
    per_shard = dict(zip(shards, _merge_rounds(job, session, [per_shard[i] for i in shards], values,
                                               _shard_resume, collected, shards)))
    if not shards:  # no shard holds a selected row: every merge of the token and output steps sees no part
        for step in plan.steps:
            merge = MERGES.get(step.merge or "")
            if step.phase in ("tokens", "output") and merge and merge.combine and merge.runs(values):
                values.update(merge.combine([], values))
    audit = _audit(job, collected, [per_shard[i] for i in shards], values)
    audit_part: WrittenPart = job.submit(_write_audit, ctx, curation_id, audit).result()
    record = new_record(plan, curation_id, snap.seq, summary, values)
    out = CurationResult(curation_id, record, summary["reasons"], snap.seq, committed=False,
                         audit=audit.cast(SELECTIONS))
    if dry_run:
        return out

    layout = part_layout(summary["selected_per_shard"], rows_per_shard(summary))
    written = [job.submit(_materialise_part, ctx, curation_id, k, slices, values,
                          *[per_shard[i] for i, _, _ in slices])
               for k, slices in enumerate(layout)]
    parts: list[_Written] = job.gather(written)
    record["old_logprobs_fallback"] = sum(w.fallback for w in parts)
    out.output_files = [w.part.relpath for w in parts] + [audit_part.relpath]
    record["output_files"] = json.dumps(out.output_files)
    if not commit:
        curated = [pq.read_table(os.path.join(buf.root, w.part.tmp_relpath)) for w in parts]
        out.curated = pa.concat_tables(curated).cast(CURATED_REFS) if curated else CURATED_REFS.empty_table()
        return out
    record_part = Part("curations", pa.Table.from_pylist([record], schema=CURATIONS), curation_id)
    referenced = referenced_paths([ctx.shard(i) for i in shards], buf.root)
    return publish(buf, lambda: [w.part for w in parts] + [audit_part, record_part], curation_id, out, referenced)


def _partition_resume(ctx: _Ctx, state: _State, values: dict, shipped: dict) -> _State:
    """A partition after the client merged the GLOBAL step it waited at."""
    _start(ctx, "select")
    return _advance(ctx, state, state.stop + 1, values, shipped)


def _shard_resume(ctx: _Ctx, state: _State, values: dict, shipped: dict, i: int) -> _State:
    return _shard_advance(ctx, i, state, state.stop + 1, values)


def _shard_state(collected: dict, i: int) -> _State:
    return _State({"work": collected["decisions"][i]})


def _merge_rounds(job: _Run, session: Session, states: list, values: dict, resume, *extra) -> list:
    """Drive parts from one GLOBAL step to the next: the parts' partial results go through the
    step's registered merge (curate.merges), or, for a `whole` step, the step runs once on the
    client over every part's `work` and the tables it writes are shipped back. `values` grows."""
    ctx = job.ctx
    while states:
        stop = job.gather([job.get(st, "stop") for st in states])
        if stop[0] is None:
            return states
        step, merge = ctx.plan.steps[stop[0]], MERGES[ctx.plan.steps[stop[0]].merge]
        shipped: dict = {}
        if merge.combine is not None:
            values.update(merge.combine(job.gather([job.get(st, "partial") for st in states]), values))
        else:
            works = [t["work"] for t in job.gather([job.get(st, "tables") for st in states])]
            session.load("work", _concat(works).sort_by("rollout_id"))
            Runner(session, dict(values)).run(step)
            shipped = {name: session.unload(name) for name in step.writes}
        if extra:
            collected, shards = extra
            states = [job.submit(resume, ctx, st, dict(values), shipped, i) for st, i in zip(states, shards)]
        else:
            states = [job.submit(resume, ctx, st, dict(values), shipped) for st in states]
    return states


def _audit(job: _Run, collected, states: list, values: dict) -> pa.Table:
    """The `whole` steps of the output phase (the audit) in one task, over every candidate's row
    and every shard's kept counts."""
    plan = job.ctx.plan
    idx = next(i for i, s in enumerate(plan.steps) if s.phase == "output" and s.merge == "whole")
    kept = [t["kept_counts"] for t in job.gather([job.get(st, "tables") for st in states])]
    tables = {"work": job.item(collected, "work").result(),
              "kept_counts": _concat(kept) if kept else pa.table(
                  {"rollout_id": pa.array([], pa.string()), "tokens_kept": pa.array([], pa.int32())})}
    return job.submit(_whole, job.ctx, idx, dict(values), tables).result()


def _existing(buf: Buffer, curation_id: str, snapshot_seq: int) -> CurationResult:
    """The committed curation with this id (run earlier, by either engine): nothing is recomputed."""
    with buf.snapshot(pin=True) as snap, Session(snap) as s:
        record = s.table("SELECT * FROM curations WHERE curation_id = $c", {"c": curation_id}).to_pylist()[0]
        audit = s.table( "SELECT * FROM selections WHERE curation_id = $c ORDER BY rollout_id",
                      {"c": curation_id}).cast(SELECTIONS)
    reasons = {}
    for reason in audit.column("reason").to_pylist():
        reasons[reason] = reasons.get(reason, 0) + 1
    return CurationResult(curation_id, record, dict(sorted(reasons.items())), snapshot_seq, committed=True,
                          already_existed=True, audit=audit, output_files=json.loads(record["output_files"]))
