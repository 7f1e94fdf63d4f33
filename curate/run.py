"""One curation run: a snapshot and a recipe in, curated shards + audit + a curation record out.

`curate` is the entry point of both engines; this module is the embedded one: every step of the
plan (`curate.plan`) runs in one DuckDB session over one pinned snapshot, in the plan's order.

Invariants:
- The run executes the plan it hashes: each step's text as built by `curate.plan.build`, with only
  its declared relations bound to files (for the candidates: the rollouts shards that hold a loop
  step's rows, by the catalog's step index, when `where` is `step_where`'s; else every one).
- Token data is read only where it is needed, and only the `entropies` of the shards that hold a
  selected row, at the selected rows' positions (the candidates' scan kept each row's shard and
  position): once by the token stage's kernels (pyarrow, decoded once into scores for every kernel
  of the stage, `curate.entropies.scored_chunks`; no token list passes through DuckDB); in a full run
  the materialisation's kernel `entropies` takes the same rows' entropies from that read (the
  token stage's spill file past its cache, else `column_at`'s cache of its last reads). The
  materialisation writes references (shard, row position, rollout_id) and kept runs, never token
  ids or log-probs; its kernel steps turn the entropies into kept runs and take the fallback flag
  from the shards' column statistics (reading `old_logprobs` only in row groups that may hold a
  null). A dry run materialises nothing.
- The commit refuses when a rollouts shard the curated rows refer to was retired meanwhile.
- Every input shard is hashed against the manifest (sha256) before anything is written or
  committed; the hashes are taken on a thread beside the queries (`steps.verifying_inputs`), and a
  mismatch is raised in place of any error of the run.
- Every candidate gets exactly one audit row with exactly one reason.
- Curated shards, audit rows and the record are published in ONE manifest commit (`output.publish`);
  a failure before it leaves nothing visible. Re-running the same curation (same id, on either
  engine) writes nothing and gives byte-identical files.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollstore.queries.session import Session
from rollstore.storage.buffer import Buffer, Part
from rollstore.storage.references import forget_columns, prefetch_logprob_facts

from .custom import choose_custom
from .finish import Decided, finish_curation
from .layout import curated_table, materialised, part_layout, part_name, referenced_paths, rows_per_shard
from .record import CurationResult, summarise
from .merges import MERGES
from .options import Dask, Limits
from .params import CurationError, ParamError, Recipe, resolve
from .plan import GLOBAL, SELECTION_PHASES, Plan, Step, build
from .entropies import release
from .steps import (
    Runner,
    batch_files,
    bound_relations,
    committed_audits,
    batch_runs,
    latest_step,
    parquet,
    run_version,
    step_inputs,
    verifying_inputs,
)

# Input shards one materialisation query covers, by their Parquet bytes (several small shards, or
# one big one) and by count: memory holds one group's selected entropies at a time.
MATERIALISE_GROUP_BYTES = 256 * 1024 * 1024
MATERIALISE_GROUP_SHARDS = 16


__all__ = ["CurationError", "CurationResult", "curate"]


def custom_statement(session: Session, recipe: Recipe) -> str | None:
    """A custom recipe's one SELECT, checked by the sandbox (part of the plan and its hash)."""
    if recipe.sql is None:
        return None
    statements = session.check_user_sql(recipe.sql)
    if len(statements) != 1:
        raise CurationError("custom recipe: the SQL file must hold exactly one SELECT statement")
    return statements[0]


def curate(
    buf: Buffer,
    recipe: Recipe,
    sets: dict[str, object] | None = None,
    snapshot_seq: int | None = None,
    *,
    commit: bool = True,
    dry_run: bool = False,
    limits: Limits = Limits(),
    engine: str | Dask = "embedded",
    session: Session | None = None,
) -> CurationResult:
    """Run `recipe` (with `sets` overrides) over a snapshot and commit its output.

    `dry_run`: the what-if audit: the record and every candidate's audit row (tokens kept
    included), no curated shards, nothing committed. `commit=False`: the full curation, returned in
    memory (`result.curated`: the curated shards' rows as stored, references) and not committed.

    `limits` (`curate.options.Limits`): DuckDB's memory limit and threads, and the timeout of the
    user SQL; past the timeout the run stops with one line, committing nothing.

    `session`: an open `Session` of this buffer to reuse (a loop pays the connection once per run);
    it is rebound to the snapshot (`Session.rebind`: nothing of an earlier job stays visible), its
    own memory limit and threads apply instead of `limits`', and it is left open.

    `engine=Dask(scheduler, partitions)` runs the same plan on dask.distributed with the same
    curation id and byte-identical output; see `curate.dask_client`."""
    if isinstance(engine, Dask):
        from .dask_client import curate_dask

        return curate_dask(buf, recipe, sets, snapshot_seq, commit=commit, dry_run=dry_run, limits=limits,
                           dask=engine)
    if engine != "embedded":
        raise ParamError(f"unknown engine {engine!r} (\"embedded\" or curate.options.Dask(...))")
    params = resolve(recipe, dict(sets or {}))
    if recipe.sql is not None and params["sample"] != "none":
        raise ParamError("a custom SQL recipe replaces the sample stage: leave `sample` at none")
    forget_columns()  # (the column cache is this curation's: earlier curations' reads are not read again)
    with buf.snapshot(snapshot_seq, pin=True) as snap, contextlib.ExitStack() as stack:
        if session is not None:  # rebound before the inputs' hashing starts: its presence check of the
            session.rebind(snap)  # new shards runs alone (beside the hashing thread)
        else:  # (a new session makes its views when a statement first names them: ~10 ms)
            session = stack.enter_context(Session(snap, limits.memory_limit, limits.threads))
        latest = None
        if params["where"] is None:  # the latest step, among the shards holding the newest rows (time index)
            newest = snap.newest_files()
            latest = latest_step(session, parquet(newest, located=True, numbered=True)) if newest else None
            params = params.with_defaults(latest, None)
        inputs = step_inputs(snap, params)  # a step's batch: only the shards it reads (the catalog's indexes)
        verified = stack.enter_context(verifying_inputs(snap, dry_run, None if inputs is None else inputs.shards))
        files = batch_files(snap) if inputs is None else inputs.files
        audits = committed_audits(snap) if inputs is None else inputs.uses_audits
        everything = parquet(files, located=True, numbered=True)
        with session.deadline(limits.timeout):
            session.check_predicate(params["where"], rollouts=parquet(files))
            if params["current_version"] is None:  # its default: the batch's own run's newest version
                runs = [latest[1]] if latest is not None else batch_runs(session, everything, params["where"])
                params = params.with_defaults(None, run_version(
                    session, lambda: parquet(snap.files("rollouts"), located=True, numbered=True), runs))
            plan = build(params, recipe, custom_statement(session, recipe))
            runner = Runner(session, dict(plan.values))
            results: dict = {}
            _run(runner, plan, ("candidates", *SELECTION_PHASES),
                 {"rollouts": everything, "selections": audits}, results)
        finite = snap.finite_files if inputs is None else (lambda: snap.finite_files(inputs.batch))
        try:
            return _output(buf, snap.seq, files, runner, plan, results, commit, dry_run, verified, finite)
        finally:
            release(runner.decoded)  # a spilled token stage's file (`curate.entropies.spill`)


def _custom(runner: Runner, step: Step, bound: dict, results: dict) -> None:
    """The embedded engine's handler of the `custom` merge: the user's SELECT, checked."""
    choose_custom(runner.session, step.text)


def _whole(runner: Runner, step: Step, bound: dict, results: dict) -> None:
    """`whole`: one session holds the whole batch, so the step runs once; its result is kept (a
    session kernel writes its table)."""
    if step.kernel is not None:
        runner.run(step)
        return
    results[step.result] = runner.table(step, bound)


def _combined(runner: Runner, step: Step, bound: dict, results: dict) -> None:
    """Every other merge: the session's result is the only partial."""
    merge = MERGES[step.merge]
    runner.values.update(merge.combine([runner.partial(step, merge.arrow, bound)], runner.values))


# One handler per registered merge (curate.merges); the Dask engine has its own table.
HANDLERS = {name: (_custom if name == "custom" else _whole if m.combine is None else _combined)
            for name, m in MERGES.items()}


def _run(runner: Runner, plan: Plan, phases: tuple[str, ...], relations: dict[str, str], results: dict) -> None:
    """Every step of `phases`, in the plan's order: a GLOBAL step through its merge's handler, any
    other as a statement. `relations` binds the steps' input relations (e.g. `rollouts`)."""
    for step in plan.steps:
        if step.phase not in phases:
            continue
        bound = bound_relations(step, relations, runner.session)
        if bound is None:
            continue
        if step.scope != GLOBAL:
            runner.run(step, bound)
        elif MERGES[step.merge].runs(runner.values):
            HANDLERS[step.merge](runner, step, bound, results)


def _output(buf: Buffer, snapshot_seq: int, files: list[str], runner: Runner, plan: Plan, results: dict,
            commit: bool, dry_run: bool, verified, finite_files=frozenset) -> CurationResult:
    curation_id = plan.curation_id(snapshot_seq)
    runner.values["curation_id"] = curation_id
    _run(runner, plan, ("record",), {}, results)
    summary = summarise(results)
    runner.values["token_budget"] = plan.params.token_budget(summary["tokens_selected"])  # K
    opened = [f for f in files if f in summary["selected_files"]]
    if not dry_run and opened:  # the selected rows' log-probs, decoded beside the token stage (curated_table checks them)
        # Files checked finite when committed are not decoded again (their sha256 is verified before the commit).
        finite = runner.values["finite_files"] = finite_files()
        unchecked = [f for f in opened if f not in finite]
        if unchecked:
            threading.Thread(target=prefetch_logprob_facts, args=(unchecked,), name="rollstore-logprobs",
                             daemon=True).start()
    # The token stage's kernels read the selected rows' entropies from their shards (`opened`, the
    # only ones holding a selected row); no step of it reads Parquet in SQL.
    _run(runner, plan, ("tokens", "output"), {}, results)
    decided = Decided(plan, snapshot_seq, summary, runner.values, results["audit"])
    layout = part_layout([summary["selected_files"][f] for f in opened], rows_per_shard(summary))

    def curated():
        current = (None, None)
        shards = _materialised(runner, plan, opened, summary["selected_files"])
        for k, slices in enumerate(layout):
            pieces = []
            for i, start, rows in slices:
                if current[0] != i:  # input shards come in order: each is materialised once
                    current = (i, next(shards))
                pieces.append(current[1].slice(start, rows))
            table, counts = curated_table(pieces, curation_id, buf.root)
            yield Part("curated", table, curation_id, curation_id, part_name(curation_id, k)[0]), counts

    verified()  # the inputs' hashes, taken beside the queries so far: before anything is written or committed
    return finish_curation(buf, decided, curated, referenced_paths(opened, buf.root), commit=commit, dry_run=dry_run)


def _materialised(runner: Runner, plan: Plan, opened: list[str], expected: dict[str, int]):
    """The materialised selected rows of each opened input shard, in order, each sorted by
    rollout_id. The query reads the session's tables, no Parquet; one query covers up to
    MATERIALISE_GROUP_SHARDS shards and MATERIALISE_GROUP_BYTES of their Parquet (a bigger shard
    alone), so the selected rows' entropies held at once stay bounded by one group's, and each
    query's fixed cost is paid once per group, not per shard."""
    materialise = plan.phase("materialise")[0]
    for group in _shard_groups(opened, MATERIALISE_GROUP_SHARDS):
        table = materialised(runner, plan, runner.table(materialise, shards=group))
        where = pc.index_in(table.column("shard_file"), value_set=pa.array(group, pa.string()))
        if where.null_count:
            raise CurationError(f"materialisation read a row of a shard outside {len(group)} opened shards; "
                                "nothing was written (please report this)")
        table = table.append_column("_shard", where)
        table = table.take(pc.sort_indices(table, [("_shard", "ascending"), ("rollout_id", "ascending")]))
        counts = np.bincount(table.column("_shard").to_numpy(zero_copy_only=False), minlength=len(group))
        if [int(n) for n in counts] != [expected[f] for f in group]:
            raise CurationError(f"materialisation read {table.num_rows} selected rows from {len(group)} shards, "
                                f"the selection has {sum(expected[f] for f in group)}; nothing was written "
                                "(please report this)")
        start = 0
        for n in counts:
            yield table.slice(start, int(n))
            start += int(n)


def _shard_groups(paths: list[str], per_query: int) -> list[list[str]]:
    """Consecutive runs of at most `per_query` shards and MATERIALISE_GROUP_BYTES on disk."""
    groups: list[list[str]] = []
    size = 0
    for path in paths:
        n = os.path.getsize(path)
        if not groups or len(groups[-1]) >= per_query or size + n > MATERIALISE_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(path)
        size += n
    return groups
