"""Curation on dask.distributed, the client side: the embedded engine's plan, SQL and bytes.
The tasks it submits are in `curate.dask_tasks`.

Invariants:
- The client builds the plan (`curate.plan`) and ships it with every task: workers run the
  client's SQL text, step by step, in the plan's order; no SQL of this module runs on the batch.
  What this module adds is running each step where it declares (`Step.at`; nothing is inferred
  from a step's phase, scope or relations) and the gathering of a step's partial results for its
  registered merge (`curate.merges`, the same merge the embedded engine uses):
  - steps `per input shard` (the candidates, the difficulty history) run per input shard; their
    rows go to partition hash(prompt_id) mod P, so a partition holds whole prompts, hence whole
    groups (a group's rows share one prompt, checked at append) and every part of its prompts'
    history (per-prompt counts add up exactly);
  - steps `per partition` run inside each partition until one with a merge: its partial results
    go through the merge on the client (μ, the batch size, one run); a step `on the client` (the
    cross-group selection, the replay choice) runs on the client over every partition's `work`
    and the tables it writes go back to every partition;
  - steps `once over every candidate` (the record; the audit) run over every candidate's narrow
    row in one task;
  - steps `per selected shard` run per input shard holding a selected row, with the same round
    trips at their merges (first missing entropies, histogram, bucket heads, kept total); a shard's
    tables (its selected rows, kept counts) travel as Arrow between its tasks, a task re-declares
    the views of earlier steps (`dask_tasks._views_before`), and each task whose kernels need the
    selected rows' entropies reads them from the shard itself (no token list travels);
  - curated shards are cut exactly as the embedded engine cuts them (`layout.part_layout`), one
    task per output shard, with the client's row-group sizing, so the worker's host does not
    change the bytes; workers write them, and the audit (beside them), only under
    BUFFER/tmp/curate-<host>-<pid>-<hex>/ (named for the client: gc keeps it while the client lives).
- The client hashes every input shard (sha256, against the manifest) on a thread while the tasks
  run (`steps.verifying_inputs`), and waits for it before any task writes a file.
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
import uuid

import pyarrow as pa

from rollstore.queries.session import Session
from rollstore.storage.buffer import Buffer
from rollstore.storage.catalog import holding
from rollstore.storage.owners import owned_name
from rollstore.storage.schema import SELECTIONS
from rollstore.storage.shardio import READ_THREADS

from . import dask_tasks as tasks
from .finish import Decided, finish_curation
from .layout import part_layout, referenced_paths, rows_per_shard
from .publish import already_committed
from .record import CurationResult
from .merges import MERGES
from .options import Dask, Limits
from .params import CurationError, ParamError, Params, Recipe, resolve
from .plan import ONCE, PER_SELECTED, build
from .steps import Runner, batch_files, batch_runs, committed_audits, parquet, run_version, verifying_inputs


def require_dask():
    """The `distributed` module, or one clear error line when it is not installed."""
    try:
        import distributed
    except ImportError:
        raise CurationError("--engine dask needs dask.distributed: pip install 'rollstore[dask]'") from None
    return distributed


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


class _Run:
    """One distributed run: submits tasks, keeps every future so a failure can cancel them all."""

    def __init__(self, client, ctx: tasks.TaskContext, run: str):
        self.client, self.ctx, self.run = client, ctx, run
        self.futures: list = []
        self.n = 0

    def submit(self, fn, *args):
        self.n += 1
        future = self.client.submit(fn, *args, key=f"curate-{self.run}-{fn.__name__.strip('_')}-{self.n}")
        self.futures.append(future)
        return future

    def get(self, future, name: str):
        return self.submit(tasks.get_attr, future, name)

    def item(self, future, i: int):
        return self.submit(tasks.get_item, future, i)

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
    *,
    commit: bool = True,
    dry_run: bool = False,
    limits: Limits = Limits(),
    dask: Dask = Dask(),
    _task_hooks: dict | None = None,
) -> CurationResult:
    """`curate.run.curate` on dask.distributed: the same curation id, curated shards and audit.
    `limits` apply to the DuckDB session of each task (threads default to 1 there), and its timeout
    to each task that evaluates the `where` predicate."""
    require_dask()
    params = resolve(recipe, dict(sets or {}))
    if recipe.sql is not None:
        raise ParamError("custom SQL recipes run on the embedded engine only (their SELECT may span groups): "
                         "drop --engine dask")
    if dask.partitions is not None and dask.partitions < 1:
        raise ParamError(f"partitions must be >= 1, got {dask.partitions}")
    with buf.snapshot(snapshot_seq, pin=True) as snap, verifying_inputs(snap, dry_run) as verified, \
            Session(snap, limits.memory_limit, limits.threads) as session, \
            _client(dask.scheduler) as client:
        client.wait_for_workers(1, timeout=120)
        versions = client.run(tasks.library_versions)
        mine = tasks.library_versions()
        for address, theirs in versions.items():
            if tuple(theirs) != mine:
                raise CurationError(f"Dask worker {address} runs duckdb/pyarrow {'/'.join(theirs)}, the client "
                                    f"{'/'.join(mine)}: every process must run the same versions")
        run = uuid.uuid4().hex[:12]
        folder = os.path.join("tmp", owned_name("curate"))  # gc keeps it while this client lives
        ctx = tasks.TaskContext(snap.frozen(), None, {}, dask.partitions or 2 * len(versions),
                                limits.memory_limit, limits.threads or 1, folder, READ_THREADS, limits.timeout,
                                dict(_task_hooks or {}), committed_audits(snap))
        job = _Run(client, ctx, run)
        with holding(buf.manifest, folder):  # a catalog's intent on the folder, taken before it is made
            os.makedirs(os.path.join(buf.root, folder))
            try:
                return _curate(buf, snap, session, job, recipe, params, commit, dry_run, verified)
            except BaseException:
                job.cancel()
                raise
            finally:
                shutil.rmtree(os.path.join(buf.root, folder), ignore_errors=True)


def _resolve(job: _Run, session: Session, params: Params) -> Params:
    """The embedded engine's defaults: `where` (the latest step, merged over shards) and
    `current_version` (the batch's run's newest version, `steps.run_version`). The user's `where` is
    checked, and read for the batch's runs, under the run's timeout, as the embedded engine does."""
    n_shards = len(job.ctx.files.listing["rollouts"])
    scans = job.gather([job.submit(tasks.scan_defaults, job.ctx, i) for i in range(n_shards)]) \
        if params["where"] is None else []
    latest = max((tuple(row) for row in scans if row is not None), default=None)
    params = params.with_defaults(latest, None)
    everything = parquet(session.snapshot.files("rollouts"))
    with session.deadline(job.ctx.timeout):
        session.check_predicate(params["where"], rollouts=everything)  # as the embedded engine
        if params["current_version"] is None:
            runs = [latest[1]] if latest is not None else batch_runs(session, everything, params["where"])
            params = params.with_defaults(None, run_version(session, everything, runs))
    return params


def _curate(buf: Buffer, snap, session: Session, job: _Run, recipe: Recipe, params: Params, commit: bool,
            dry_run: bool, verified) -> CurationResult:
    batch_files(snap)  # none: an empty batch, before any task
    params = _resolve(job, session, params)
    plan = build(params, recipe)
    curation_id = plan.curation_id(snap.seq)
    if commit and not dry_run and already_committed(buf, curation_id):
        return _existing(buf, curation_id, snap.seq)
    values = {**plan.values, "curation_id": curation_id}
    ctx = job.ctx = dataclasses.replace(job.ctx, plan=plan, values=dict(values))
    n_shards, n_parts = len(ctx.files.listing["rollouts"]), ctx.partitions

    # Candidates per input shard, shuffled to partitions by prompt; the selection steps per
    # partition, with a round trip to the client at each GLOBAL step (its registered merge).
    maps = [job.submit(tasks.map_shard, ctx, i) for i in range(n_shards)]
    states = [job.submit(tasks.partition_start, ctx, *[job.item(m, j) for m in maps]) for j in range(n_parts)]
    del maps
    states = _merge_rounds(job, session, states, values, tasks.partition_resume)

    # Every candidate's row in one task: the record's numbers and the per-shard decisions.
    collected = job.submit(tasks.collect, ctx, *states)
    del states
    summary = job.item(collected, "summary").result()
    values["token_budget"] = plan.params.token_budget(summary["tokens_selected"])  # K
    shards = [i for i, n in enumerate(summary["selected_per_shard"]) if n]
    first = plan.first(PER_SELECTED)
    per_shard = {i: job.submit(tasks.shard_advance, ctx, i, job.submit(tasks.shard_state, collected, i), first, dict(values))
                 for i in shards}
    per_shard = dict(zip(shards, _merge_rounds(job, session, [per_shard[i] for i in shards], values,
                                               tasks.shard_resume, collected, shards)))
    if not shards:  # no shard holds a selected row: every merge of the token and output steps sees no part
        for step in plan.steps:
            merge = MERGES.get(step.merge or "")
            if step.at == PER_SELECTED and merge and merge.combine and merge.runs(values):
                values.update(merge.combine([], values))
    audit = _audit(job, collected, [per_shard[i] for i in shards], values)
    layout = part_layout(summary["selected_per_shard"], rows_per_shard(summary))

    audit_written = []  # the audit is written by a worker beside the curated shards

    def curated():
        audit_written.append(job.submit(tasks.write_audit, ctx, curation_id, audit))
        written = [job.submit(tasks.materialise_part, ctx, curation_id, k, slices, values,
                              *[per_shard[i] for i, _, _ in slices])
                   for k, slices in enumerate(layout)]
        for w in job.gather(written):
            yield w.part, w.counts

    verified()  # the inputs' hashes, taken beside the tasks so far: before anything is written or committed
    return finish_curation(buf, Decided(plan, snap.seq, summary, values, audit), curated,
                           referenced_paths([ctx.shard(i) for i in shards], buf.root), commit=commit,
                           dry_run=dry_run, audit_part=lambda: audit_written[0].result())


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
            session.load("work", tasks.concat(works).sort_by("rollout_id"))
            Runner(session, dict(values)).run(step)
            shipped = {name: session.unload(name) for name in step.writes}
        if extra:
            collected, shards = extra
            states = [job.submit(resume, ctx, st, dict(values), shipped, i) for st, i in zip(states, shards)]
        else:
            states = [job.submit(resume, ctx, st, dict(values), shipped) for st in states]
    return states


def _audit(job: _Run, collected, states: list, values: dict) -> pa.Table:
    """The step placed `once over every candidate` after the token stage (the audit) in one task,
    over every candidate's row and every shard's kept counts."""
    plan = job.ctx.plan
    idx = next(i for i, s in enumerate(plan.steps) if i > plan.first(PER_SELECTED) and s.at == ONCE)
    kept = [t["kept_counts"] for t in job.gather([job.get(st, "tables") for st in states])]
    tables = {"work": job.item(collected, "work").result(),
              "kept_counts": tasks.concat(kept) if kept else pa.table(
                  {"rollout_id": pa.array([], pa.string()), "tokens_kept": pa.array([], pa.int32())})}
    return job.submit(tasks.whole_step, job.ctx, idx, dict(values), tables).result()


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
