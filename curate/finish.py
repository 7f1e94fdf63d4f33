"""What a curation produces, shared by both engines: the record, the audit, the cut of curated
rows into shards, and the one commit that publishes them. Both engines end in `finish_curation`.

Invariants:
- The record's numbers come from the plan's record steps over every candidate; its variances are
  summed exactly (math.fsum), so they do not depend on row order, threads or engine.
- Curated rows are cut input shard after input shard (the snapshot's order), each shard's rows
  sorted by rollout_id, into shards of `rows_per_shard` rows (`part_layout`): both engines cut the
  same way, so they write the same bytes.
- A curated row refers to its rollouts row (the shard's manifest path, its position in the file,
  its rollout_id) and copies no token list (schema `CURATED_REFS`); the commit refuses when a
  referenced rollouts shard was retired while the curation ran, so a committed curation's
  references name live shards.
- Curated shards, the audit and the record are published in ONE manifest commit; a failure before
  it leaves nothing visible, and an identical curation already committed is never written twice.
- `ahead` builds the next part on a second thread while the committer writes the current one; the
  parts, their order and the commit are the same as without it.
- The audit is known before any curated row is made: the embedded engine writes it under its own
  folder in tmp/ on a thread (`Beside`) while the curated rows are materialised, with the bytes a
  `Part` would get; the commit links it into place, and the folder is removed whatever happens.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import queue
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rollstore.storage.buffer import Buffer, Part, WrittenPart, write_part
from rollstore.storage.catalog import holding
from rollstore.storage.owners import owned_name
from rollstore.storage.schema import CURATED_REFS, CURATIONS, SELECTIONS
from rollstore.storage.shardio import ROW_GROUP_BYTES

from .params import CurationError
from .plan import Plan
from .tokens import check_kept, run_lengths

CURATED_SHARD_BYTES = ROW_GROUP_BYTES


# The reasons that refuse a candidate before any group statistic (docs/curation.md §Eligibility).
REFUSALS = frozenset({"invalid", "truncated", "stale", "reused"})


@dataclass
class CurationResult:
    curation_id: str
    record: dict
    reasons: dict[str, int]
    snapshot_seq: int
    committed: bool = True
    already_existed: bool = False
    audit: pa.Table | None = field(default=None, repr=False)  # a repr stays one screen, whatever the batch
    curated: pa.Table | None = field(default=None, repr=False)
    output_files: list[str] = field(default_factory=list, repr=False)

    def refusal(self) -> str | None:
        """One line saying why, when the batch had candidates and every one was refused before the
        pool (`REFUSALS`: nothing of it can ever be trained, whatever the recipe); else None. The
        curate command and the loop exit non-zero with it (docs/curation.md §Eligibility)."""
        n = self.record.get("n_candidates") or 0
        if not n or any(reason not in REFUSALS for reason in self.reasons):
            return None
        params = json.loads(self.record["params"]) if isinstance(self.record.get("params"), str) else {}
        why = {"invalid": "no verdict (correct is null) or a verify_error",
               "truncated": "finish_reason length or abort, with truncated=drop",
               "stale": (f"policy_version below current_version {params.get('current_version')} − max_policy_lag "
                         f"{params.get('max_policy_lag')}"),
               "reused": f"selected max_reuse = {params.get('max_reuse')} times already"}
        counts = "; ".join(f"{k} {v}: {why[k]}" for k, v in sorted(self.reasons.items(), key=lambda kv: -kv[1]))
        return f"every one of {n} candidates was refused before selection ({counts}); nothing to train"


def summarise(results: dict) -> dict:
    """The record's numbers from the record steps' results (over every candidate of the run), and
    the selected rows per input shard (filename -> rows)."""
    counts = results["counts"].to_pylist()  # per (reason, selected, a selected row's shard): n, tokens
    values = results["variances"]
    selected = values.column("selected").to_numpy(zero_copy_only=False).astype(bool)
    after = values.column("after").to_numpy(zero_copy_only=False)[selected]
    reasons: dict[str, int] = {}
    files: dict[str, int] = {}
    for r in counts:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + int(r["n"])
        if r["selected"]:
            files[r["filename"]] = files.get(r["filename"], 0) + int(r["n"])
    return {
        "n_candidates": sum(int(r["n"]) for r in counts),
        "n_selected": sum(int(r["n"]) for r in counts if r["selected"]),
        "tokens_candidate": sum(int(r["tokens"]) for r in counts),
        "tokens_selected": sum(int(r["tokens"]) for r in counts if r["selected"]),
        "adv_var_before": exact_var_pop(values.column("before").to_numpy(zero_copy_only=False)),
        "adv_var_after": exact_var_pop(after),
        "reasons": dict(sorted(reasons.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))),
        "selected_files": files,
    }


def exact_var_pop(values: np.ndarray) -> float | None:
    """Population variance with exactly rounded sums: the same float whatever the order of values."""
    values = values[~np.isnan(values)] if values.dtype.kind == "f" else values.astype(np.float64)
    if len(values) == 0:
        return None
    mean = math.fsum(values) / len(values)
    return math.fsum((values - mean) ** 2) / len(values)


def new_record(plan: Plan, curation_id: str, snapshot_seq: int, summary: dict, values: dict) -> dict:
    """The curation's record from its summary and the run's final values (threshold, tokens kept)."""
    p = plan.params
    threshold = values.get("threshold")
    stages = plan.record_fields(summary["n_selected"])
    return {
        "curation_id": curation_id,
        "created_at": dt.datetime.now(dt.timezone.utc),
        "recipe": plan.recipe,
        "params": p.to_json(),
        "sql_sha256": plan.sha256(),
        "snapshot_seq": snapshot_seq,
        "progress": float(p["progress"]),
        "sample_budget": stages["sample_budget"],
        "token_fraction": stages["token_fraction"],
        "token_threshold": threshold[0] if threshold else None,
        "n_candidates": summary["n_candidates"],
        "n_selected": summary["n_selected"],
        "tokens_candidate": summary["tokens_candidate"],
        "tokens_kept": int(values["tokens_kept"]),
        "adv_var_before": summary["adv_var_before"],
        "adv_var_after": summary["adv_var_after"],
        "old_logprobs_fallback": None,  # counted while the curated rows are materialised
        "output_files": "[]",
    }


def rows_per_shard(summary: dict) -> int:
    """Rows per curated shard: about CURATED_SHARD_BYTES of learner input each."""
    n_selected = summary["n_selected"]
    per_row = max(1, (summary["tokens_selected"] * 14 + n_selected * 64) // max(1, n_selected))
    return max(1, CURATED_SHARD_BYTES // per_row)


def part_layout(rows_per_input: list[int], per_shard: int) -> list[list[tuple[int, int, int]]]:
    """The cut of the curated rows (input shard after input shard) into curated shards of
    `per_shard` rows: per output shard, its (input shard, first row, rows) slices."""
    parts, current, filled = [], [], 0
    for i, n in enumerate(rows_per_input):
        start = 0
        while start < n:
            take = min(n - start, per_shard - filled)
            current.append((i, start, take))
            filled, start = filled + take, start + take
            if filled == per_shard:
                parts.append(current)
                current, filled = [], 0
    if filled:
        parts.append(current)
    return parts


def part_name(curation_id: str, k: int) -> tuple[str, str]:
    """(name, relative path) of curated shard k."""
    name = f"part-{k:05d}"
    return name, f"curated/{curation_id}/{name}.parquet"


def audit_path(curation_id: str) -> str:
    return f"audit/{curation_id}/audit.parquet"


def sorted_by_rollout(table: pa.Table) -> pa.Table:
    return table.take(pc.sort_indices(table, [("rollout_id", "ascending")]))


def materialised(runner, plan: Plan, table: pa.Table) -> pa.Table:
    """Rows of `curate_materialise.sql` after the plan's kernel steps of the materialisation (the
    loss mask as kept runs in place of the entropies, the fallback flag), in the plan's order;
    done before the rows are sorted, so a sort moves no token list."""
    for step in plan.phase("materialise"):
        if step.kernel is not None:
            table = runner.kernel(step, table)
    return table


class PartCounts(NamedTuple):
    """What one curated shard adds to the record: rows that fell back to gen_logprobs, tokens kept."""

    fallback: int
    kept: int


def curated_table(pieces: list[pa.Table], curation_id: str, root: str) -> tuple[pa.Table, PartCounts]:
    """One curated shard's table (references, schema CURATED_REFS) from consecutive slices of
    materialised input shards (`materialised`: with their kept runs and fallback flags), and how
    many of its rows fell back to gen_logprobs and the tokens its masks keep. `root`: the buffer
    root; each row's input shard is stored as the manifest's path under it."""
    table = pa.concat_tables(pieces)
    fallback = int(pc.sum(table.column("fallback")).as_py() or 0)
    table = table.add_column(0, "curation_id", pa.array([curation_id] * table.num_rows, pa.string()))
    table = table.append_column("rollouts_shard", manifest_paths(table.column("shard_file"), root))
    kept = int(run_lengths(table.column("keep_runs").combine_chunks()).sum())
    return table.select(CURATED_REFS.names).cast(CURATED_REFS), PartCounts(fallback, kept)


def manifest_paths(files: pa.ChunkedArray, root: str) -> pa.Array:
    """Full paths of shards under `root` → their paths as the manifest records them."""
    encoded = files.combine_chunks().dictionary_encode()
    prefix = os.path.join(root, "")
    names = []
    for name in encoded.dictionary.to_pylist():
        if not name.startswith(prefix):
            raise ValueError(f"{name}: a curated row refers to a shard outside the buffer {root}")
        names.append(name[len(prefix):])
    return pa.array(names, pa.string()).take(encoded.indices)


def referenced_paths(files: list[str], root: str) -> list[str]:
    """The manifest paths of the input shards a curation's rows refer to."""
    return manifest_paths(pa.chunked_array([pa.array(files, pa.string())]), root).to_pylist()


def already_committed(buf: Buffer, curation_id: str) -> bool:
    """Whether the manifest holds a live record of this curation: the only test of "committed"
    (files on disk without a manifest row are orphans of a crashed run, never trusted)."""
    return buf.manifest.live_key_count("curations", curation_id) > 0


def retired_paths(con, paths, manifest) -> list[str]:
    """Of the rollouts shard `paths`, those no live manifest row names and whose rows no compaction
    moved into another shard (inside `con`'s transaction; references to a moved shard resolve)."""
    live = {r[0] for r in con.execute(
        "SELECT path FROM shards WHERE table_name = 'rollouts' AND removed_seq IS NULL")}
    gone = [p for p in paths if p not in live]
    if gone:
        moved = manifest.moves(con)
        gone = [p for p in gone if p not in moved]
    return gone


class _AlreadyCommitted(Exception):
    pass


def ahead(items):
    """Yield `items`, producing the next one on a background thread while the caller handles the
    current one (at most one item waits). Materialising a part (DuckDB) and writing the previous
    one (pyarrow's Parquet writer is single-threaded) then overlap; both release the GIL.

    The producer's exception is raised in the caller; when the caller stops early (an error while
    writing, or a close), the producer stops after its current item and `items` is closed."""
    slot: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def put(message) -> bool:
        while not stop.is_set():
            try:
                slot.put(message, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(("item", item)):
                    break
            else:
                put(("done", None))
        except BaseException as exc:  # handed to the caller, raised there
            put(("error", exc))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    worker = threading.Thread(target=produce, name="rollstore-materialise", daemon=True)
    worker.start()
    try:
        while True:
            kind, value = slot.get()
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        worker.join()


def selected_meanwhile(buf: Buffer, con, snapshot_seq: int, curation_id: str, rollout_ids: pa.Array
                       ) -> tuple[str, str] | None:
    """(rollout_id, curation_id) of the first of `rollout_ids` (this curation's audit rows) that a
    live curation committed after `snapshot_seq` selected, or None. Runs inside the commit's
    manifest transaction (`con`), which no other commit can interleave: only the audit shards of
    curations committed meanwhile are read (usually none), their `rollout_id` and `selected`."""
    rows = con.execute(
        "SELECT s.path, s.key FROM shards s WHERE s.table_name = 'selections' AND s.removed_seq IS NULL "
        "AND s.added_seq > ? AND s.key IS NOT ? AND EXISTS (SELECT 1 FROM shards c WHERE c.table_name = "
        "'curations' AND c.key = s.key AND c.removed_seq IS NULL) ORDER BY s.shard_id",
        (snapshot_seq, curation_id)).fetchall()
    if not rows:
        return None
    ours = pc.unique(rollout_ids)
    for path, key in rows:
        theirs = pq.read_table(os.path.join(buf.root, path), columns=["rollout_id", "selected"])
        picked = theirs.filter(pc.fill_null(theirs.column("selected"), False)).column("rollout_id")
        both = ours.filter(pc.is_in(ours, value_set=picked.combine_chunks()))
        if len(both):
            return pc.min(both).as_py(), key
    return None


def use_capped(out: CurationResult, capped: bool) -> tuple[int, pa.Array] | None:
    """(snapshot seq, the audit's rollout ids) of a curation whose plan caps uses (`Plan.use_capped`:
    replay, `max_reuse`), whose counted uses its commit re-checks; None for any other."""
    if out.audit is None or not capped:
        return None
    return out.snapshot_seq, out.audit.column("rollout_id").combine_chunks()


def publish(buf: Buffer, parts, curation_id: str, out: CurationResult, referenced: list[str] = (),
            capped: bool = False) -> CurationResult:
    """Commit `parts()` (curated shards, the audit, the record) in ONE manifest transaction, unless
    the manifest says this curation is already committed (then nothing is written: the run is
    idempotent). A concurrent identical run that commits first makes this one roll back, and so
    does a rollouts shard of `referenced` (manifest paths the curated rows refer to) that was
    retired meanwhile (compacted or quarantined): the references would not resolve. With a use cap
    (`capped`, `use_capped`), a curation committed after this one's snapshot that selected one of its
    candidates makes this one roll back: the uses it counted (and the cap it applied) are out of
    date."""
    capped = use_capped(out, capped)

    def refuse_duplicate(con, _seq, _ids):
        if buf.manifest.live_key_count("curations", curation_id, con) > 1:
            raise _AlreadyCommitted()
        gone = retired_paths(con, referenced, buf.manifest)
        if gone:
            raise CurationError(f"rollouts shard {gone[0]} was retired while this curation ran (compaction or "
                                "quarantine); nothing was committed: curate again")
        if capped is not None:
            clash = selected_meanwhile(buf, con, capped[0], curation_id, capped[1])
            if clash is not None:
                raise CurationError(f"rollout_id={clash[0]!r} was selected by curation {clash[1]}, committed "
                                    f"meanwhile (after snapshot {capped[0]}): the uses this curation counted are "
                                    "out of date; nothing was committed: curate again")

    out.committed = True
    if already_committed(buf, curation_id):
        out.already_existed = True
        return out
    try:
        buf.commit(parts(), "curate", {"curation_id": curation_id}, refuse_duplicate)
    except _AlreadyCommitted:
        out.already_existed = True
    except FileExistsError:
        # A file of this curation is named by the manifest but its record is not live (e.g. a
        # concurrent identical run committed between our check and our link): decide again.
        if not already_committed(buf, curation_id):
            raise
        out.already_existed = True
    return out


@dataclass
class Decided:
    """What a curation decided, before anything is written: the plan and the snapshot it ran on,
    the summary of the record steps, the run's $values (with `curation_id`) and the audit."""

    plan: Plan
    snapshot_seq: int
    summary: dict
    values: dict
    audit: pa.Table


# An engine's curated shards, in order (shard k is `part_name(curation_id, k)`): each as a `Part`
# (rows in memory) or a `WrittenPart` (a file a worker wrote under tmp/), with its `PartCounts`.
CuratedParts = Callable[[], Iterator[tuple[Part | WrittenPart, PartCounts]]]


def finish_curation(buf: Buffer, decided: Decided, curated: CuratedParts, referenced: list[str], *,
                    commit: bool, dry_run: bool,
                    audit_part: Callable[[], Part | WrittenPart] | None = None) -> CurationResult:
    """The end both engines share. The record; a dry run returns it with the audit and writes
    nothing; otherwise the curated shards, the audit (`audit_part`: a file the engine wrote, else
    the audit rows) and the record go out in ONE commit (`publish`: `referenced` are the rollouts
    shards the curated rows point to), or, with `commit=False`, the curated rows come back in
    memory and nothing is committed."""
    cid = decided.values["curation_id"]
    record = new_record(decided.plan, cid, decided.snapshot_seq, decided.summary, decided.values)
    audit = decided.audit.cast(SELECTIONS)
    out = CurationResult(cid, record, decided.summary["reasons"], decided.snapshot_seq, committed=False, audit=audit)
    if dry_run:
        return out

    beside = None
    if audit_part is None and commit:  # the audit is known: write it while the curated rows are made
        beside = Beside(buf.root, Part("selections", audit, cid, cid, "audit"), buf.manifest)
        audit_part = beside.result

    def parts():
        if beside is not None:
            beside.start()
        record["old_logprobs_fallback"] = kept = 0
        files = []
        for k, (part, counts) in enumerate(curated()):
            record["old_logprobs_fallback"] += counts.fallback
            kept += counts.kept
            files.append(part_name(cid, k)[1])
            yield part
        check_kept(kept, record["tokens_kept"])  # the masks written keep what the audit counted
        files.append(audit_path(cid))
        out.output_files = files
        record["output_files"] = json.dumps(files)
        yield audit_part() if audit_part is not None else Part("selections", audit, cid, cid, "audit")
        yield Part("curations", pa.Table.from_pylist([record], schema=CURATIONS), cid)

    if not commit:
        tables = [p.table if isinstance(p, Part) else pq.read_table(os.path.join(buf.root, p.tmp_relpath))
                  for p in parts() if p.table_name == "curated"]
        out.curated = pa.concat_tables(tables).cast(CURATED_REFS) if tables else CURATED_REFS.empty_table()
        return out
    try:
        return publish(buf, lambda: ahead(parts()), cid, out, referenced, decided.plan.use_capped)
    finally:
        if beside is not None:
            beside.close()


class Beside:
    """One part written under its own folder in tmp/ on a thread (`start`), beside the work that
    comes before its commit; `result` waits for it (a `WrittenPart`, or the writer's error).
    `close` waits for the writer, then removes the folder: nothing of it is left, whether the
    commit linked the file into place (its temp name is gone then) or failed before."""

    def __init__(self, root: str, part: Part, catalog=None):
        self.root, self.part = root, part
        self.folder = os.path.join("tmp", owned_name("curate"))  # gc keeps it while this process lives
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollstore-beside")
        self.future = None
        self.catalog = catalog
        self.held = ExitStack()  # a catalog's intent on the folder (storage.catalog.holding)

    def start(self) -> None:
        if self.future is None:
            self.held.enter_context(holding(self.catalog, self.folder))
            os.makedirs(os.path.join(self.root, self.folder))
            self.future = self.pool.submit(write_part, self.root, self.part, self.folder)

    def result(self) -> WrittenPart:
        self.start()
        return self.future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.future is not None:
            shutil.rmtree(os.path.join(self.root, self.folder), ignore_errors=True)
        self.held.close()
