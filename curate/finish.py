"""The end both engines share (`finish_curation`): the record, then a dry run's answer, the rows in
memory (`commit=False`), or ONE commit of the curated shards, the audit and the record.

Its parts: the record (`curate.record`), the cut into curated shards (`curate.layout`), the commit
(`curate.publish`), the threads beside it (`curate.threads`).

Invariants:
- Curated shards, the audit and the record are published in ONE manifest commit; a failure before
  it leaves nothing visible, and an identical curation already committed is never written twice.
- `ahead` builds the next part on a second thread while the committer writes the current one; the
  parts, their order and the commit are the same as without it.
- The audit is known before any curated row is made: the embedded engine writes it under its own
  folder in tmp/ on a thread (`Beside`) while the curated rows are materialised, with the bytes a
  `Part` would get; the commit links it into place, and the folder is removed whatever happens.
- The masks written keep exactly the tokens the audit counted (`check_kept`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from rollstore.storage.buffer import Buffer, Part, WrittenPart
from rollstore.storage.schema import CURATED_REFS, CURATIONS, SELECTIONS

from .layout import PartCounts, audit_path, part_name
from .plan import Plan
from .publish import publish
from .record import CurationResult, new_record
from .threads import Beside, ahead
from .tokens import check_kept


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
