"""One curation run: a snapshot and a recipe in, curated shards + audit + a curation record out.

`curate` is the entry point of both engines; this module is the embedded one: every step of the
plan (`curate.plan`) runs in one DuckDB session over one pinned snapshot, in the plan's order.

Invariants:
- The run executes the plan it hashes: each step's text as built by `curate.plan.build`, with only
  its declared relations bound to files (all rollouts shards for the candidates; for the token and
  materialisation steps, only the shards that hold a selected row).
- Token data is read at most once: the selected rows' entropies once (curate_token_entropies.sql),
  their token ids and log-probs once, by materialisation. A dry run materialises nothing, so it
  never reads token ids or log-probs.
- Every candidate gets exactly one audit row with exactly one reason.
- Curated shards, audit rows and the record are published in ONE manifest commit (`output.publish`);
  a failure before it leaves nothing visible. Re-running the same curation (same id, on either
  engine) writes nothing and gives byte-identical files.
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from queries.session import DEFAULT_MEMORY_LIMIT, Session
from storage.buffer import Buffer, Part
from storage.schema import CURATED, CURATIONS, SELECTIONS

from .custom import apply_custom_recipe
from .output import (
    CurationResult,
    ahead,
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
from .params import CurationError, ParamError, Recipe, resolve, token_budget
from .plan import Plan, Step, build
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
from .tokens import check_exact, merge_histograms, mask_values, missing_entropies_error, pick_bucket, threshold_of

# Parquet bytes one materialisation query may read (several small shards, or one big one).
MATERIALISE_GROUP_BYTES = 256 * 1024 * 1024

DEFAULT_TIMEOUT = 600.0  # seconds for the stages that run user SQL (`where`, a custom recipe)

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
    commit: bool = True,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    threads: int | None = None,
    engine: str = "embedded",
    scheduler=None,
    partitions: int | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    session: Session | None = None,
    dry_run: bool = False,
) -> CurationResult:
    """Run `recipe` (with `sets` overrides) over a snapshot and commit its output.

    `dry_run`: the what-if audit: the record and every candidate's audit row (tokens kept
    included), no curated shards, nothing committed. `commit=False`: the full curation, returned in
    memory (`result.curated`) and not committed.

    `session`: an open `Session` of this buffer to reuse (a loop pays the connection once per run);
    it is rebound to the snapshot (`Session.rebind`: nothing of an earlier job stays visible), its
    own limits apply instead of `memory_limit`/`threads`, and it is left open.

    `timeout` (seconds; None or 0: none) bounds the steps that run user SQL (the `where`
    predicate and a custom recipe's SELECT); past it the run stops with one line, committing nothing.

    `engine="dask"` runs the same plan on dask.distributed (`scheduler`: "local:N", a scheduler
    address, or a `distributed.Client`; `partitions`: hash partitions of the batch) with the same
    curation id and byte-identical output; see `curate.distributed`."""
    if engine == "dask":
        from .distributed import curate_dask

        return curate_dask(buf, recipe, sets, snapshot_seq=snapshot_seq, commit=commit, memory_limit=memory_limit,
                           threads=threads, scheduler=scheduler, partitions=partitions, dry_run=dry_run)
    if engine != "embedded":
        raise ParamError(f"unknown engine {engine!r} (embedded or dask)")
    if scheduler is not None or partitions is not None:
        raise ParamError("a scheduler and partitions are options of the dask engine: add --engine dask")
    params = resolve(recipe, dict(sets or {}))
    if recipe.sql is not None and params["sample"] != "none":
        raise ParamError("a custom SQL recipe replaces the sample stage: leave `sample` at none")
    with buf.snapshot(snapshot_seq, pin=True) as snap, (
            contextlib.nullcontext(session.rebind(snap.verify(CURATION_INPUTS))) if session is not None
            else Session(snap.verify(CURATION_INPUTS), memory_limit, threads)) as session:
        files = snap.files("rollouts")
        if not files:
            raise CurationError("empty batch: the snapshot has no rollouts")
        everything = parquet(files, located=True)
        version = latest_checkpoint(session)
        params = with_defaults(params, latest_step(session, everything) if params["where"] is None else None,
                               version if version is not None else latest_policy(session, everything))
        with session.deadline(timeout):
            session.check_predicate(params["where"])
            plan = build(params, recipe, custom_statement(session, recipe))
            runner = Runner(session, dict(plan.values))
            sample_budget = _select(runner, plan, everything)
        return _output(buf, snap.seq, files, runner, plan, sample_budget, commit, dry_run)


def _select(runner: Runner, plan: Plan, everything: str) -> int | None:
    """Candidates to the final selection: every step of the phases before the record."""
    session = runner.session
    for step in plan.phase("candidates"):
        runner.run(step, {"rollouts": everything} if "rollouts" in step.relations else None)
    if session.one("SELECT count(*) FROM work")[0] == 0:
        raise CurationError(f"empty batch: no rollouts match where = {plan.params['where']}")
    sample_budget = None
    for step in plan.steps:
        if step.phase in ("candidates", "record", "tokens", "output"):
            continue
        if step.merge == "mu":
            runner.values["mu"] = mu_of(runner.rows(step))
        elif step.merge == "custom":
            sample_budget = apply_custom_recipe(session, step.text)
        else:  # every other step; a GLOBAL one's input is the whole batch here, already in `work`
            runner.run(step)
    if plan.counts_budget:
        sample_budget = session.one("SELECT count(*) FROM work WHERE selected")[0]
    return sample_budget


def _threshold(runner: Runner, plan: Plan, summary: dict, opened: list[str]):
    """Token selection's input and exact threshold (and the budget K it was found for; None without
    a token stage): the selected rows' entropies, read once."""
    steps = {s.sql: s for s in plan.phase("tokens")}
    if not plan.token_stage:
        runner.run(steps["curate_no_entropies"])
        return None, None
    # No shard holds a selected row: an empty relation, so no entropies are read at all.
    runner.run(steps["curate_token_entropies"],
               {"rollouts": parquet(opened) if opened else "(SELECT * FROM rollouts WHERE false)"})
    missing = runner.rows(steps["curate_missing_entropies"])
    if missing:
        raise missing_entropies_error(missing[0][0], plan.params["token"])
    runner.run(steps["curate_token_scores"])
    k = token_budget(summary["tokens_selected"], plan.params.token_fraction())
    found = pick_bucket(merge_histograms([runner.rows(steps["curate_token_histogram"])]), k)
    if found is None:
        return None, k
    bucket, offset = found
    head = runner.table(steps["curate_token_bucket"], bucket=bucket, n=offset + 1)
    return threshold_of([head], offset), k


def _output(buf: Buffer, snapshot_seq: int, files: list[str], runner: Runner, plan: Plan,
            sample_budget: int | None, commit: bool, dry_run: bool) -> CurationResult:
    session = runner.session
    curation_id = plan.curation_id(snapshot_seq)
    summary = summarise(runner, plan)
    opened = [f for f in files if f in summary["selected_files"]]
    threshold, k = _threshold(runner, plan, summary, opened)
    runner.values.update(mask_values(threshold), curation_id=curation_id)
    out_steps = {s.sql: s for s in plan.phase("output")}
    runner.run(out_steps["curate_tokens_kept"])
    tokens_kept = session.one("SELECT coalesce(sum(tokens_kept), 0) FROM kept_counts")[0]
    if k is not None:
        check_exact(k, tokens_kept)
    record = new_record(plan, curation_id, snapshot_seq, summary, sample_budget, threshold, tokens_kept)
    audit = runner.table(out_steps["curate_audit"]).cast(SELECTIONS)
    out = CurationResult(curation_id, record, summary["reasons"], snapshot_seq, committed=False, audit=audit)
    if dry_run:
        return out

    layout = part_layout([summary["selected_files"][f] for f in opened], rows_per_shard(summary))

    def parts():
        record["old_logprobs_fallback"] = 0
        output_files, current = [], (None, None)
        shards = _materialised(runner, out_steps["curate_materialise"], opened)
        for k, slices in enumerate(layout):
            pieces = []
            for i, start, rows in slices:
                if current[0] != i:  # input shards come in order: each is materialised once
                    current = (i, next(shards))
                pieces.append(current[1].slice(start, rows))
            table, fallback = curated_table(pieces, curation_id)
            record["old_logprobs_fallback"] += fallback
            name, path = part_name(curation_id, k)
            output_files.append(path)
            yield Part("curated", table, curation_id, curation_id, name)
        output_files.append(audit_path(curation_id))
        out.output_files = output_files
        record["output_files"] = json.dumps(output_files)
        yield Part("selections", audit, curation_id, curation_id, "audit")
        yield Part("curations", pa.Table.from_pylist([record], schema=CURATIONS), curation_id)

    if not commit:
        curated = [part.table for part in parts() if part.table_name == "curated"]
        out.curated = pa.concat_tables(curated) if curated else CURATED.empty_table()
        return out
    return publish(buf, lambda: ahead(parts()), curation_id, out)


def _materialised(runner: Runner, materialise: Step, opened: list[str]):
    """The materialised selected rows of each opened input shard, in order, each sorted by
    rollout_id. One query reads as many shards as the session has threads, up to
    MATERIALISE_GROUP_BYTES of Parquet (a bigger shard alone): DuckDB parallelises a scan by row
    group, and a small shard is one row group, so shard-by-shard reads ran on one thread. Memory
    stays bounded by one group's selected rows."""
    for group in _shard_groups(opened, max(1, runner.session.threads())):
        table = runner.table(materialise, {"rollouts": parquet(group)})
        if len(group) == 1:
            yield sorted_by_rollout(table)
            continue
        members = [runner.session.con.sql("SELECT rollout_id FROM work WHERE selected AND filename = $f",
                                          params={"f": f}).to_arrow_table().column("rollout_id") for f in group]
        ends = np.cumsum([len(m) for m in members])
        if table.num_rows != ends[-1]:
            raise CurationError(f"materialisation read {table.num_rows} selected rows from {len(group)} shards, "
                                f"the selection has {int(ends[-1])}; nothing was written (please report this)")
        position = pc.index_in(table.column("rollout_id"), value_set=pa.chunked_array(members).combine_chunks())
        shard = np.searchsorted(ends, position.to_numpy(zero_copy_only=False), side="right")
        order = pc.sort_indices(pa.table({"shard": shard, "rollout_id": table.column("rollout_id")}),
                                [("shard", "ascending"), ("rollout_id", "ascending")])
        table = table.take(order)
        for start, end in zip(np.concatenate([[0], ends[:-1]]), ends):
            yield table.slice(int(start), int(end - start))


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
