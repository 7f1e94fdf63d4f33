"""Running plan steps in one DuckDB session: binding values; what the run's defaults are read from.

Invariants:
- A step runs exactly the text its plan holds (rendered from the plan's copy of the SQL file, so a
  Dask worker runs the client's SQL), with only the relations the step declares rebound; a kernel
  step runs its registered function through `curate.kernels.apply` (its relations checked), a
  session kernel through `curate.kernels.run_session` (`run`: its temp table is loaded; `partial`:
  its table is the step's partial result). The decoded input of session kernels is kept for the
  next kernel of the run and dropped when an SQL step runs.
- Values are bound by DuckDB (`$name`), never pasted into the text; a value a step needs but the
  runner lacks is a programming error, raised before anything runs.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa

from rollstore.queries import load_sql, needed_values, render
from rollstore.queries.session import Session, tables_named

from rollstore.storage.snapshot import SnapshotFiles, rollouts_relation, sql_string, string_range, union_option

from .entropies import drop_chunks
from .kernels import KERNELS, run_session
from .kernels import apply as apply_kernel
from .params import EmptyBatch, run_of_where, step_of_where
from .plan import Step

# Tables a curation reads: their shards are verified (size and sha256) before a run uses them.
CURATION_INPUTS = ["rollouts", "selections", "curations", "checkpoints"]


@contextlib.contextmanager
def verifying_inputs(snap, dry_run: bool, shards=None):
    """The snapshot's curation inputs hashed against the manifest (sha256) on a background thread
    beside the run's queries or tasks (most selection steps leave a core idle): yields `done`, which
    returns once every input is hashed and raises the first mismatch; both engines call it before
    anything is written or committed. When the run fails, a mismatch is raised in its place (a
    corrupt file explains a failed query). A dry run commits nothing, so it hashes nothing (at 1 B
    tokens that is 10 GiB read once more) and checks each input's size: `done` returns at
    once. `shards`: the shards the run reads, when known (a loop's step,
    `step_inputs`): only those are hashed, not every shard of CURATION_INPUTS."""
    if dry_run:  # each input's place and size (one lstat each), before a query reads it
        if shards is None:
            snap.check_present(CURATION_INPUTS)
        else:
            snap.check_shards(shards)
        yield lambda: None
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollstore-verify") as pool:
        hashed = pool.submit(snap.verify, CURATION_INPUTS) if shards is None else pool.submit(snap.verify_shards, shards)
        try:
            yield hashed.result
        except BaseException:
            if hashed.exception() is not None:
                raise hashed.exception() from None
            raise
        hashed.result()


class Runner:
    """Runs steps in `session` with `values` (a dict the engine extends as the run goes: μ, the
    token threshold, the curation id)."""

    def __init__(self, session: Session, values: dict):
        self.session = session
        self.values = values
        self.decoded: dict = {}  # session kernels' decoded input (curate.entropies.scored_chunks), until an SQL step runs

    def _session_kernel(self, step: Step) -> pa.Table:
        return run_session(step, self.session, self.values, self.decoded)

    def _sql(self, step: Step, bound: dict, extra: dict) -> tuple[str, dict]:
        drop_chunks(self.decoded)  # an SQL step may rewrite what a session kernel decoded; past the kernels, memory is freed
        sql = step.render(**bound)
        return sql, needed_values(sql, {**self.values, **extra})

    def run(self, step: Step, bound: dict | None = None, **extra) -> None:
        if step.kernel is not None:  # a session kernel writing a temp table
            self.session.load(KERNELS[step.kernel].into, self._session_kernel(step))
            return
        sql, args = self._sql(step, bound or {}, extra)
        self.session.execute(sql, args or None, reads=step_tables(step, bound or {})).fetchall()

    def rows(self, step: Step, bound: dict | None = None, **extra) -> list[tuple]:
        sql, args = self._sql(step, bound or {}, extra)
        return self.session.execute(sql, args or None, reads=step_tables(step, bound or {})).fetchall()

    def table(self, step: Step, bound: dict | None = None, **extra) -> pa.Table:
        sql, args = self._sql(step, bound or {}, extra)
        return self.session.table(sql, args or None, reads=step_tables(step, bound or {}))

    def kernel(self, step: Step, table: pa.Table) -> pa.Table:
        """A kernel step over `table` (its declared input and output checked, `curate.kernels.apply`)."""
        return apply_kernel(step, table, self.values)

    def partial(self, step: Step, arrow: bool, bound: dict | None = None):
        """A GLOBAL step's result over the part this session holds (rows, or an Arrow table)."""
        if step.kernel is not None:
            table = self._session_kernel(step)
            return table if arrow else [tuple(r.values()) for r in table.to_pylist()]
        return self.table(step, bound) if arrow else self.rows(step, bound)


@dataclass(frozen=True)
class Audits:
    """The `selections` an engine binds for the uses step (queries/curate_uses.sql): the audit shards
    of the snapshot's committed curations (`committed_audits`), narrowed in each session to those
    whose rollout_id range (footer statistics, `storage.snapshot.string_range`) meets the range of
    the session's `work`. A loop's batch is rows no past curation saw: no shard is left, and the
    step is skipped instead of reading an audit per past curation. `excluded`: curations whose rows
    a compacted audit shard holds but that do not count (their record is not in the snapshot)."""

    paths: tuple[str, ...]
    excluded: tuple[str, ...] = ()

    def relation(self, session: Session) -> str | None:
        """The relation over the shards left, or None when none is."""
        if not self.paths:
            return None
        low, high = session.one(load_sql("curate_work_range"))
        if low is None:
            return None
        files = [p for p in self.paths if _meets(string_range(p, "rollout_id"), low, high)]
        if not files:
            return None
        listing = ", ".join(sql_string(p) for p in files)
        relation = f"read_parquet([{listing}], hive_partitioning = false{union_option(files)})"
        if self.excluded:
            left = ", ".join(sql_string(c) for c in self.excluded)
            relation = f"(SELECT * FROM {relation} WHERE curation_id NOT IN ({left}))"
        return relation


def _meets(span: tuple[str, str] | None, low: str, high: str) -> bool:
    return span is None or (span[0] <= high and low <= span[1])


def committed_audits(snap) -> Audits:
    """The audit shards of the snapshot's committed curations: those whose key (their curation id)
    is the key of a `curations` shard. Both are written in one commit; a curation whose record
    shard was retired (quarantined) does not count, as the spec's `curations` join says. A shard
    that compaction merged from several curations' audits (`storage.maintenance.compact`) counts for
    those of its curations that are committed (`Audits.excluded`: the others)."""
    shards, excluded = _committed_audit_shards(snap, None)
    return Audits(tuple(os.path.join(snap.root, s.path) for s in shards), excluded)


def _committed_audit_shards(snap, since: int | None) -> tuple[list, tuple[str, ...]]:
    """`committed_audits`' shards and excluded curations; with `since`, only the shards committed after
    commit `since` (a record and its audit share their commit, so both listings are index ranges; a
    merged shard's curations are looked up among every record, which happens once after a compaction)."""
    if since is None:
        curations, audits = snap.shards("curations"), snap.shards("selections")
    else:
        curations, audits = snap.shards_after("curations", since), snap.shards_after("selections", since)
    committed = {s.key for s in curations}
    merged = snap.shard_keys([s.shard_id for s in audits if s.key is None])
    if since is not None and any(k not in committed for keys in merged.values() for k in keys):
        committed = {s.key for s in snap.shards("curations")}
    out, excluded = [], set()
    for s in audits:
        keys = merged.get(s.shard_id, [s.key])
        if any(k in committed for k in keys):
            out.append(s)
            excluded.update(k for k in keys if k not in committed)
    return out, tuple(sorted(excluded))


@dataclass(frozen=True)
class StepInputs:
    """What a loop's curation of one step reads, found by the catalog's indexes (`step_inputs`)."""

    root: str
    batch: list  # the rollouts shards holding the step's rows (`Snapshot.step_shards`)
    audits: list  # the committed audit shards that may name one of their rows
    checkpoints: list  # the checkpoint shards read for the default current_version: none when indexed
    excluded: tuple = ()  # curations of a merged audit shard that do not count (`committed_audits`)

    @property
    def files(self) -> list[str]:
        return [os.path.join(self.root, s.path) for s in self.batch]

    @property
    def uses_audits(self) -> Audits:
        return Audits(tuple(os.path.join(self.root, s.path) for s in self.audits), self.excluded)

    @property
    def shards(self) -> list:
        return [*self.batch, *self.audits, *self.checkpoints]


def step_inputs(snap, params) -> StepInputs | None:
    """The inputs of a curation whose `where` is `step_where`'s (a loop's step), when the step index
    names its shards; None otherwise (every shard of CURATION_INPUTS is an input, as before). A past
    curation can have selected a row only if it committed after the row's shard was added: the audits
    read are those committed after the oldest batch shard — all of them when a batch shard was written
    by compaction (its rows are older than it). None of the indexes grows the work with the history."""
    step = step_of_where(params["where"])
    if step is None or isinstance(snap, SnapshotFiles):
        return None
    run, s = step
    replay = params["replay"] != "none"
    batch = snap.step_shards("rollouts", run, None if replay else s, None if replay else s)
    if not batch:
        return None
    since = None if snap.written_by_compaction(batch) else min(b.added_seq for b in batch) - 1
    checkpoints = snap.shards("checkpoints") if snap.newest_checkpoints([run]) is None else []
    audits, excluded = _committed_audit_shards(snap, since)
    return StepInputs(snap.root, batch, audits, checkpoints, excluded)


def bound_relations(step: Step, relations: dict, session: Session) -> dict | None:
    """The relations `step` reads as `relations` binds them (a text, or `Audits` narrowed in this
    session); None when one of them is left with no file: the step has nothing to read, and is
    skipped."""
    bound = {}
    for name in step.relations:
        if name in relations:
            value = relations[name]
            bound[name] = value.relation(session) if isinstance(value, Audits) else value
            if bound[name] is None:
                return None
    return bound


def step_tables(step: Step, bound: dict) -> set | None:
    """The snapshot tables whose views an SQL step reads: those it declares (`reads`) but the
    relations the engine bound to files, and those its fragments (a user's `where`) name; None (the
    tables its text names) for the user's SELECT of a custom recipe."""
    if step.sql == "custom":
        return None
    declared = tables_named(" ".join({r.split(".", 1)[0] for r in step.reads} - set(bound)))
    for name, text in step.fragments:
        if name not in bound:
            declared |= tables_named(str(text))
    return declared


def parquet(paths: list[str], located: bool = False, numbered: bool = False) -> str:
    """A relation over these rollouts shards (with their `filename` when `located`, and each row's
    position in its file, `file_row_number`, when `numbered`: what a curated row refers to), with
    `response_length` whatever the shards' schema version (`storage.snapshot.rollouts_relation`)."""
    return rollouts_relation(paths, located, numbered)


def latest_step(session: Session, rollouts: str) -> tuple | None:
    """(created_at, run_id, step) of the newest rollout of `rollouts`, or None."""
    return session.one(render("curate_latest_step", {"rollouts": rollouts}), reads=())  # a relation over files


def batch_runs(session: Session, rollouts: str, where: str) -> list[str]:
    """The run_ids of the rows `where` matches (queries/curate_batch_runs.sql), sorted; a `where` of
    `step_where`'s form names its run, so the query is not run (a loop's curation of a step)."""
    run = run_of_where(where)
    if run is not None:
        return [run]
    table = session.table(render("curate_batch_runs", {"rollouts": rollouts, "where": where}), reads=())
    return [str(r) for r in table.column("run_id").to_pylist() if r is not None]


# (checkpoint shard path, sha256) -> (run_id, version): a checkpoint shard is immutable and holds one
# row, so a loop that publishes one a step reads each once per process.
_CHECKPOINT_RUNS: dict[tuple[str, str], tuple[str, int]] = {}


def checkpoint_versions(session: Session) -> dict[str, int]:
    """The newest checkpoint version of each run_id (queries/curate_checkpoint_runs.sql). Shards
    known to the manifest are read once per process; a frozen snapshot (a Dask worker's) reads them all."""
    snap = session.snapshot
    if isinstance(snap, SnapshotFiles):  # a listing: paths only
        keyed = {path: None for path in snap.files("checkpoints")}
    else:
        keyed = {os.path.join(snap.root, s.path): (s.path, s.sha256) for s in snap.shards("checkpoints")}
    missing = [path for path, key in keyed.items() if key is None or key not in _CHECKPOINT_RUNS]
    read: dict[str, tuple[str, int]] = {}
    if missing:
        files = "[" + ", ".join(sql_string(p) for p in missing) + "]"
        for row in session.table(render("curate_checkpoint_runs", {"files": files}), reads=()).to_pylist():
            read[row["filename"]] = (str(row["run_id"]), int(row["version"]))
    newest: dict[str, int] = {}
    for path, key in keyed.items():
        run, version = read[path] if path in read else _CHECKPOINT_RUNS[key]
        if key is not None and path in read:
            _CHECKPOINT_RUNS[key] = (run, version)
        newest[run] = max(version, newest.get(run, version))
    return newest


def run_version(session: Session, rollouts, runs: list[str]) -> int | None:
    """The default current_version of a batch whose rows belong to `runs` (docs/choices.md §Runs):
    the newest checkpoint published under one of those run ids; when none has one, the newest
    checkpoint of a run that sampled no rollouts (a learner of other runs' rows, such as `rollstore
    train`'s); else the newest policy_version the runs' rows were sampled with. In a buffer of one run
    (or of one `generate` run and one `train` run) this is the buffer-wide rule of earlier versions:
    the newest checkpoint, else the newest policy_version.
    `rollouts`: a relation over every rollouts shard, or a function that makes it (called only when
    no checkpoint of the runs answers: a loop's step reads no shard for its version)."""
    newest = session.snapshot.newest_checkpoints(list(runs))  # (None from a listing without a catalog)
    if newest:  # the runs' own newest checkpoints by the catalog's index, no checkpoint file read
        return max(newest.values())
    checkpoints = checkpoint_versions(session)
    own = [checkpoints[r] for r in runs if r in checkpoints]
    if own:
        return max(own)
    others = sorted(set(checkpoints) - set(runs))
    if callable(rollouts):
        rollouts = rollouts()
    if others:
        sampled = session.table(render("curate_sampling_runs", {"rollouts": rollouts}), {"runs": others}, reads=())
        learners = set(others) - {str(r) for r in sampled.column("run_id").to_pylist()}
        if learners:
            return max(checkpoints[r] for r in learners)
    row = session.one(render("curate_latest_policy", {"rollouts": rollouts}), {"runs": list(runs)}, reads=())
    return None if row is None or row[0] is None else int(row[0])


def batch_files(snap) -> list[str]:
    """Every rollouts shard of the snapshot, the batch of a `where` that is not one step's (a step's
    reads only the shards the step index names: `step_inputs`); none is an empty batch."""
    files = snap.files("rollouts")
    if not files:
        raise EmptyBatch.of(None)
    return files
