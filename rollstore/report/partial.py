"""A session over part of a pinned snapshot (`partial_session`): the tables a command reads, and of a
table keyed by curation only that curation's shards, so that the command's cost follows what it
reads, not the buffer's history (a long run holds thousands of shards per table, and a session over
the whole snapshot reads every file's footer to make its views).

Invariants:
- Every file of the session is a shard of the snapshot `snap`, which the caller keeps pinned
  (`buf.snapshot(pin=True)`) for the session's life; each one is checked present (size) first.
- A table not named reads as an empty table: a caller names every table its SQL reads.
- `keys` keeps the shards of `selections` or `curations` whose catalog key is one of the given
  curation ids, the audit shards compaction merged from several curations that hold one of them
  (`Snapshot.shard_keys`), and those with no key otherwise (shards written before keys: any
  curation's rows): every writer keys a curation's audit and record shards by its id
  (curate.finish, curate.dask_tasks), so the rows of those curations are all there. SQL over such a
  session must still filter by curation id.
"""

from __future__ import annotations

import os

from rollstore.queries.session import Session
from rollstore.storage.schema import TABLES
from rollstore.storage.snapshot import Snapshot, SnapshotFiles
from rollstore.storage.verify import check_present

KEYED = ("selections", "curations")  # tables whose shards are keyed by curation id


def partial_session(snap: Snapshot, tables: list[str], keys: list[str] | None = None, **kwargs) -> Session:
    """A Session whose views read `tables` of `snap` (with `keys`: only those curations' shards of the
    `KEYED` tables among them) and nothing of the other tables. `kwargs` go to `Session`."""
    unknown = set(tables) - set(TABLES)
    if unknown:
        raise ValueError(f"no table {sorted(unknown)[0]!r}")
    listing: dict[str, tuple] = {name: () for name in TABLES}
    folders: dict = {}
    for name in tables:
        shards = snap.shards(name)
        if keys is not None and name in KEYED:
            wanted = set(keys)
            merged = snap.shard_keys([s.shard_id for s in shards if s.key is None])
            shards = [s for s in shards if s.key in wanted or (s.key is None and (
                s.shard_id not in merged or wanted.intersection(merged[s.shard_id])))]
        check_present(snap.root, shards, folders)
        snap.declare_schemas(shards)  # (their views bind without reading every footer)
        listing[name] = tuple(os.path.join(snap.root, s.path) for s in shards)
    moves = snap.moves() if "curated" in tables else {}
    return Session(SnapshotFiles(snap.root, snap.seq, listing, moves), **kwargs)
