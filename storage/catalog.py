"""The catalog seam: where a buffer's manifest operations go.

A buffer's catalog records what is committed: commits (snapshot numbers), shard rows, rollout and
group ids, leases, pins. Two implementations share one interface, `Catalog`:
- the embedded SQLite manifest (`manifest.Manifest`, `BUFFER/manifest.sqlite`): the default, for a
  buffer folder without a descriptor; nothing about it changes;
- PostgreSQL (`catalog_pg.PgManifest`), for a buffer folder with `BUFFER/catalog.json` written by
  `rollstore init BUF --catalog postgresql://...`: hosts that mount the folder share one catalog.

Invariants:
- `open_manifest(root)` picks the implementation from the folder alone: a descriptor means its
  catalog, else `manifest.sqlite`; a folder with both is refused (one line), never guessed.
- Every write through `Catalog.transaction()` is serialised against every other writer of the same
  buffer (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: a transaction-level advisory lock), so snapshot
  numbers are assigned in commit order and a snapshot never changes.
- Code above `storage/` sees the same operations and the same errors (sqlite3's exception classes,
  `ManifestError` lines) whichever catalog a buffer has.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Iterable, Protocol

from . import descriptor
from .errors import ManifestError
from .manifest import MANIFEST, Manifest, NewShard, Shard


class Catalog(Protocol):
    """What a buffer asks of its catalog (the methods `Buffer`, `Snapshot`, gc, compaction, curation
    and the learner call). `con` is the transaction's connection: `execute(sql, params)` and
    `executemany` in the manifest's SQL dialect, cursors with fetchone/fetchall/rowcount/lastrowid."""

    root: str
    path: str  # where the catalog is, for messages (a file, or a redacted DSN)
    read_only: str | None

    def close(self) -> None: ...
    def require_writable(self) -> None: ...
    def transaction(self) -> AbstractContextManager[Any]: ...
    def new_commit(self, con: Any, kind: str, detail: dict | None = None) -> int: ...
    def latest_seq(self) -> int: ...
    def add_shards(self, con: Any, seq: int, shards: list[NewShard]) -> list[int]: ...
    def shards(self, table: str | None = None, seq: int | None = None) -> list[Shard]: ...
    def shards_by_id(self, ids: list[int]) -> list[Shard]: ...
    def live_key_count(self, table: str, key: str, con: Any = None) -> int: ...
    def live_paths(self, table: str, con: Any = None) -> list[tuple[int, str]]: ...
    def ack_paths(self, con: Any, paths: list[str], consumer: str, group: str, now: float) -> list[str]: ...
    def is_unnamed(self, path: str) -> bool: ...
    def all_paths(self) -> set[str]: ...
    def existing_ids(self, rollout_ids: list[str], group_ids: list[str]) -> tuple[set[str], set[str]]: ...
    def register_rollouts(self, con: Any, shard_id: int, pairs: Iterable[tuple[str, str]],
                          groups: Iterable[str]) -> None: ...
    def lease(self, table: str, n: int, consumer: str, group: str = "default",
              ttl: float = 600.0) -> tuple[str, list[Shard]]: ...
    def ack(self, shard_ids: list[int], consumer: str, group: str = "default") -> int: ...
    def pin(self, seq: int, ttl: float = 3600.0) -> str: ...
    def unpin(self, pin_id: str) -> None: ...
    def collected_seq(self) -> int: ...
    def finite_checked(self, digests: list[str]) -> set[str]: ...
    def oldest_pinned_seq(self) -> int | None: ...


def holding(catalog, relpath: str) -> AbstractContextManager[None]:
    """While a working file or folder under tmp/ (`relpath`) is in use: an intent on it in a catalog
    that has write intents (PostgreSQL: gc of any host leaves it alone, whatever its age; it is
    taken before the folder is made and released after it is removed); nothing for the embedded
    manifest, whose gc judges tmp/ by its owner's pid."""
    hold = getattr(catalog, "holding", None)
    return nullcontext() if hold is None else hold(relpath)


def is_cataloged(root: str) -> bool:
    """True when the buffer at `root` has a descriptor (its catalog is not the embedded manifest)."""
    return descriptor.exists(root)


def _refuse_both(root: str) -> None:
    if descriptor.exists(root) and os.path.exists(os.path.join(root, MANIFEST)):
        raise ManifestError(f"{root}: holds both {MANIFEST} and {descriptor.DESCRIPTOR}; a buffer has one "
                            "catalog: move the one that does not belong away")


def open_manifest(root: str, create: bool = False, catalog: str | None = None, data: str | None = None) -> Catalog:
    """The catalog of the buffer at `root`. `create`: make it when missing (with `catalog`, a DSN:
    a buffer cataloged there; without, the embedded manifest unless the folder has a descriptor)."""
    _refuse_both(root)
    if data is not None and catalog is None:
        raise ManifestError(f"--data {data}: a store needs a catalog every host reaches (give --catalog postgresql://...)")
    if catalog is not None:
        if not create:
            raise ValueError("a catalog DSN is given only when creating a buffer")
        from .catalog_pg import PgManifest, create as create_pg

        return PgManifest(root, create_pg(root, catalog, data))
    if descriptor.exists(root):
        from .catalog_pg import PgManifest

        return PgManifest(root)
    return Manifest(root, create=create)
