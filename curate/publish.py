"""The one commit that publishes a curation (`publish`): curated shards, audit and record in ONE
manifest transaction, with the checks made inside it.

Invariants:
- A failure before the commit leaves nothing visible, and an identical curation already committed
  is never written twice (`already_committed`; a concurrent identical run that commits first makes
  this one roll back).
- The commit refuses when a rollouts shard the curated rows refer to was retired while the
  curation ran, so a committed curation's references name live shards (`retired_paths`); with a use
  cap, when a curation committed meanwhile selected one of its candidates (`selected_meanwhile`).
- `retired_paths` and `selected_meanwhile` ask the catalog inside the commit's transaction
  (`Catalog.retired_paths`, `Catalog.committed_since`); no SQL runs here.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rollstore.storage.buffer import Buffer

from .params import CurationError
from .record import CurationResult


def already_committed(buf: Buffer, curation_id: str) -> bool:
    """Whether the manifest holds a live record of this curation: the only test of "committed"
    (files on disk without a manifest row are orphans of a crashed run, never trusted)."""
    return buf.manifest.live_key_count("curations", curation_id) > 0


def retired_paths(con, paths, manifest) -> list[str]:
    """Of the rollouts shard `paths`, those no live manifest row names and whose rows no compaction
    moved into another shard (inside `con`'s transaction; references to a moved shard resolve)."""
    return manifest.retired_paths(con, list(paths))


class _AlreadyCommitted(Exception):
    pass


def selected_meanwhile(buf: Buffer, con, snapshot_seq: int, curation_id: str, rollout_ids: pa.Array
                       ) -> tuple[str, str] | None:
    """(rollout_id, curation_id) of the first of `rollout_ids` (this curation's audit rows) that a
    live curation committed after `snapshot_seq` selected, or None. Runs inside the commit's
    manifest transaction (`con`), which no other commit can interleave: only the audit shards of
    curations committed meanwhile are read (usually none), their `rollout_id` and `selected`."""
    rows = buf.manifest.committed_since(con, "selections", snapshot_seq, curation_id)
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
