"""The worker side of curation on dask.distributed: the tasks, and the context each one gets.

Invariants:
- A task is a pure function of its arguments (a `TaskContext`, Arrow tables, values): it runs the
  client's SQL text, step by step, in the plan's order, in a fresh sandboxed `Session` without a
  snapshot (or, for the steps that read the whole snapshot, over its pinned file list), and
  returns Arrow tables or files written under the run's folder. Dask may rerun it after losing a
  worker and gets the same rows and bytes.
- Tasks never open the manifest: they read the pinned snapshot's file list (`SnapshotFiles`), and
  write only under BUFFER/tmp/curate-<host>-<pid>-<hex>/ (the client's run folder).
- Placement is each step's declaration (`Step.at`, see `curate.dask_client` for the whole flow):
  steps `per input shard` run in `map_shard`, the tables they write tagged with the partition
  hash(prompt_id) mod P; steps `per partition` in `partition_start`, `partition_resume`, until a
  step with a merge, whose partial result they return (or, `on the client`, whose tables they
  hand over); steps `once over every candidate` in one task (`collect` before the token stage,
  `whole_step` after it); steps `per selected shard` in `shard_advance`, `shard_resume`, and the
  materialisation's (SQL and kernels) in one task per curated shard (`materialise_part`), cut as
  the embedded engine cuts them.
- The `where` predicate (the user's SQL) runs only in `map_shard`, under the run's timeout
  (`TaskContext.timeout`), per task.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from rollstore.queries.session import Session
from rollstore.storage.buffer import Part, WrittenPart, write_part
from rollstore.storage.schema import SELECTIONS
from rollstore.storage.snapshot import SnapshotFiles

from .layout import PartCounts, audit_path, curated_table, materialised, part_name, sorted_by_rollout
from .record import summarise
from .merges import MERGES
from .plan import ON_CLIENT, ONCE, PER_PARTITION, PER_SELECTED, PER_SHARD, Plan, Step
from .steps import Audits, Runner, bound_relations, latest_step, parquet

# ---- what every task gets --------------------------------------------------------------------
@dataclass(frozen=True)
class TaskContext:
    files: SnapshotFiles
    plan: Plan | None  # the client's plan: every step's SQL text travels with it (None while the defaults are resolved)
    values: dict  # the $values of the run so far (μ joins them after its merge)
    partitions: int
    memory_limit: str
    threads: int
    folder: str  # tmp/curate-<run>, relative to the buffer root
    write_threads: int  # the client's READ_THREADS: row groups as the embedded engine would cut them
    timeout: float | None  # seconds each task that evaluates the user's `where` may run (None, 0: none)
    hooks: dict = field(default_factory=dict)  # tests: {task kind: seconds to sleep first, or "fail"}
    audits: Audits = Audits(())  # the committed curations' audit shards (`steps.committed_audits`): the uses step's input

    def shard(self, i: int) -> str:
        return self.files.listing["rollouts"][i]


def _start(ctx: TaskContext, kind: str) -> None:
    hook = ctx.hooks.get(kind)
    if hook == "fail":
        raise RuntimeError(f"test hook: {kind} task failed")
    if hook:
        time.sleep(hook)


def _session(ctx: TaskContext, shard: str | None = None, whole: bool = False) -> Session:
    """A sandboxed DuckDB session for a task: over the whole snapshot (`whole`), one input shard
    as `rollouts`, or nothing but what the task loads."""
    if whole:
        return Session(ctx.files, ctx.memory_limit, ctx.threads)
    return Session(None, ctx.memory_limit, ctx.threads, root=ctx.files.root, rollouts=shard)


def _split(table: pa.Table | None, column: str, n: int) -> list[pa.Table | None]:
    if table is None:
        return [None] * n
    return [table.filter(pc.equal(table.column(column), i)) for i in range(n)]


def concat(tables: list[pa.Table]) -> pa.Table:
    return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]


def _views_before(plan: Plan, start: int, places: tuple[str, ...]) -> list[Step]:
    """The view steps placed at `places` before `start`: a view is a definition, not data, so a
    task that resumes a part re-declares the views its earlier steps made (the tables travel as
    Arrow)."""
    return [s for s in plan.steps[:start] if s.at in places and s.merge is None and " TEMP VIEW " in s.text]


@contextlib.contextmanager
def _resumed(ctx: TaskContext, tables: dict[str, pa.Table], start: int, values: dict, places: tuple[str, ...]):
    """A task's session over a part's tables, with the views of its earlier steps re-declared."""
    with _session(ctx) as s:
        for name, table in tables.items():
            s.load(name, table)
        runner = Runner(s, values)
        for view in _views_before(ctx.plan, start, places):
            runner.run(view)
        yield s, runner


@dataclass
class State:
    """A part between two GLOBAL steps: its tables (narrow `work` rows, its prompts' history, a
    shard's kept counts; never a token list), the GLOBAL step it waits at, its partial result."""

    tables: dict[str, pa.Table]
    stop: int | None = None  # index of the GLOBAL step the part waits at (None: done)
    partial: object = None  # its share of that step's result (None for a `whole` step)


@dataclass
class Written:
    part: WrittenPart
    counts: PartCounts


def get_attr(obj, name: str):
    return getattr(obj, name)


def get_item(obj, i: int):
    return obj[i]


# ---- tasks ------------------------------------------------------------------------------------
def scan_defaults(ctx: TaskContext, i: int):
    """The latest (created_at, run_id, step) of one input shard, or None."""
    _start(ctx, "scan")
    source = parquet([ctx.shard(i)])
    with _session(ctx) as s:
        return latest_step(s, source)


def map_shard(ctx: TaskContext, i: int) -> list[dict[str, pa.Table]]:
    """The steps placed `per input shard`, over input shard i: `rollouts` bound to the shard with
    each row's file and position (what `work` keeps), `rows` to the shard alone; the tables they
    write, split by partition (`work` tagged with the shard). The `where` predicate sees the whole
    snapshot, as in the embedded engine."""
    _start(ctx, "map")
    inputs = {"rollouts": parquet([ctx.shard(i)], located=True, numbered=True), "rows": parquet([ctx.shard(i)]),
              "selections": ctx.audits}
    with _session(ctx, whole=True) as s, s.deadline(ctx.timeout):
        runner = Runner(s, dict(ctx.values))
        names: dict[str, None] = {}  # the tables the steps wrote, each unloaded once, after the last step
        for step in ctx.plan.steps:
            bound = bound_relations(step, inputs, s) if step.at == PER_SHARD else None
            if bound is not None:  # None: not placed here, or nothing to read (`steps.bound_relations`)
                runner.run(step, bound)
                names.update(dict.fromkeys(step.writes))
        written = {name: _tag(s.unload(name), i if name == "work" else None, ctx.partitions) for name in names}
    split = {name: _split(table, "part", ctx.partitions) for name, table in written.items()}
    return [{name: parts[j] for name, parts in split.items()} for j in range(ctx.partitions)]


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


def partition_start(ctx: TaskContext, *pieces: dict[str, pa.Table]) -> State:
    """A partition's share of the tables the per-shard steps wrote (its rows, its prompts' history
    parts), then its steps up to one with a merge."""
    _start(ctx, "groups")
    tables = {name: concat([p[name] for p in pieces]) for name in pieces[0]}
    return _advance(ctx, State(tables), 0, dict(ctx.values), {})


def _advance(ctx: TaskContext, state: State, start: int, values: dict, shipped: dict[str, pa.Table]) -> State:
    """A partition from step `start`: the steps placed `per partition` (or `on the client`, which
    stop it), until one with a merge (returning its partial result) or the first step placed
    `once over every candidate` (the record: the selection is over)."""
    places = (PER_PARTITION, ON_CLIENT)
    with _resumed(ctx, {**state.tables, **shipped}, start, values, places) as (s, runner):
        for idx in range(start, len(ctx.plan.steps)):
            step = ctx.plan.steps[idx]
            if step.at == ONCE:
                break
            if step.at not in places:
                continue
            if step.merge is not None:
                merge = MERGES[step.merge]
                partial = runner.partial(step, merge.arrow) if merge.combine is not None else None
                return State(_tables(s), idx, partial)
            runner.run(step)
        return State(_tables(s))


def _tables(s: Session) -> dict[str, pa.Table]:
    """Every temp table of a task's session, as Arrow (views stay definitions)."""
    return {name: s.unload(name) for name in s.temp_tables()}


def collect(ctx: TaskContext, *states: State) -> dict:
    """Every candidate's final narrow row in one task: the steps placed `once over every
    candidate` before the first step `per selected shard` (the record), and per input shard the
    selected rows that the token and output steps need."""
    _start(ctx, "collect")
    n_shards = len(ctx.files.listing["rollouts"])
    work = concat([st.tables["work"] for st in states])
    with _session(ctx) as s:
        s.load("work", work)
        runner = Runner(s, dict(ctx.values))
        results = {step.result: runner.table(step) for step in ctx.plan.steps[:ctx.plan.first(PER_SELECTED)]
                   if step.at == ONCE}
    summary = summarise(results)
    selected = work.filter(pc.fill_null(work.column("selected"), False)).sort_by([("shard", "ascending"),
                                                                                ("rollout_id", "ascending")])
    decisions = _split(selected, "shard", n_shards)
    summary["selected_per_shard"] = [t.num_rows for t in decisions]
    return {"work": work, "summary": summary,
            "decisions": [t if t.num_rows else None for t in decisions]}


def _decision(collected: dict, i: int) -> pa.Table:
    return collected["decisions"][i]


def shard_advance(ctx: TaskContext, i: int, state: State, start: int, values: dict) -> State:
    """One input shard's steps placed `per selected shard` from step `start` (its selected rows as
    `work`, its tables so far), until one with a merge (returning its partial result) or the next
    step placed `once over every candidate` (the audit, `whole_step`)."""
    _start(ctx, "tokens")
    with _resumed(ctx, state.tables, start, values, (PER_SELECTED,)) as (s, runner):
        for idx in range(start, len(ctx.plan.steps)):
            step = ctx.plan.steps[idx]
            if step.at == ONCE:
                break
            if step.at != PER_SELECTED:
                continue
            if step.merge is not None:
                merge = MERGES[step.merge]
                if not merge.runs(values):
                    continue
                return State(_tables(s), idx, runner.partial(step, merge.arrow))
            runner.run(step, {"rollouts": parquet([ctx.shard(i)])} if step.relations else None)
        return State(_tables(s))


def _write(ctx: TaskContext, table_name: str, table: pa.Table, relpath: str, key: str) -> WrittenPart:
    return write_part(ctx.files.root, Part(table_name, table, key), ctx.folder, relpath, ctx.write_threads)


def materialise_part(ctx: TaskContext, curation_id: str, k: int, slices: list, values: dict, *states: State) -> Written:
    """One curated shard: slices (shard, start, rows) of materialised input shards, written to tmp."""
    _start(ctx, "materialise")
    step = ctx.plan.phase("materialise")[0]
    pieces = []
    for (i, start, rows), state in zip(slices, states):
        with _session(ctx) as s:
            for name, table in state.tables.items():
                s.load(name, table)
            runner = Runner(s, values)
            table = materialised(runner, ctx.plan, runner.table(step, shards=[ctx.shard(i)]))
            pieces.append(sorted_by_rollout(table).slice(start, rows))
    table, counts = curated_table(pieces, curation_id, ctx.files.root)
    name, path = part_name(curation_id, k)
    return Written(_write(ctx, "curated", table, path, curation_id), counts)


def whole_step(ctx: TaskContext, idx: int, values: dict, tables: dict[str, pa.Table]) -> pa.Table:
    """A `whole` step of the output phase in one task, over every part's tables concatenated."""
    _start(ctx, "audit")
    with _session(ctx) as s:
        for name, table in tables.items():
            s.load(name, table)
        return Runner(s, values).table(ctx.plan.steps[idx])


def write_audit(ctx: TaskContext, curation_id: str, audit: pa.Table) -> WrittenPart:
    return _write(ctx, "selections", audit.cast(SELECTIONS), audit_path(curation_id), curation_id)



def library_versions() -> tuple[str, str]:
    import duckdb

    return duckdb.__version__, pa.__version__


def partition_resume(ctx: TaskContext, state: State, values: dict, shipped: dict) -> State:
    """A partition after the client merged the GLOBAL step it waited at."""
    _start(ctx, "select")
    return _advance(ctx, state, state.stop + 1, values, shipped)


def shard_resume(ctx: TaskContext, state: State, values: dict, shipped: dict, i: int) -> State:
    return shard_advance(ctx, i, state, state.stop + 1, values)


def shard_state(collected: dict, i: int) -> State:
    return State({"work": collected["decisions"][i]})


