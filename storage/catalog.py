"""The catalog seam: every operation a buffer asks of its catalog, one abstract class.

A buffer's catalog records what is committed: commits (snapshot numbers), shard rows, rollout and
group ids, leases, pins, the checkpoint index and ledger. `Catalog` (below) names every operation;
two siblings implement all of them over one shared body of SQL (`catalog_sql.SqlCatalog`, which asks
a `dialect.Dialect` where the two databases differ):
- the embedded SQLite manifest (`manifest.Manifest`, `BUFFER/manifest.sqlite`): the default, for a
  buffer folder without a descriptor;
- PostgreSQL (`catalog_pg.PgManifest`), for a buffer folder with `BUFFER/catalog.json` written by
  `rollstore init BUF --catalog postgresql://...`: hosts that mount the folder (or share a store)
  share one catalog.

Invariants:
- `open_manifest(root)` picks the implementation from the folder alone: a descriptor means its
  catalog, else `manifest.sqlite`; a folder with both is refused (one line), never guessed.
- Every write through `Catalog.transaction()` is serialised against every other writer of the same
  buffer (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: a transaction-level advisory lock), so snapshot
  numbers are assigned in commit order and a snapshot never changes.
- Every operation exists on every implementation: what one catalog needs and the other does not
  (write intents and their heartbeat, the consumed ledger's publish-time record, a store's objects)
  is a no-op or a plain answer on the other, so callers never ask which catalog they hold.
- Code above `storage/` sees the same operations and the same errors (`errors.CatalogError` and its
  kinds, `ManifestError` lines), never a driver's (sqlite3, psycopg) exception class; it runs no SQL
  of its own against the catalog. The `con` a transaction yields is handed back to the catalog's
  `*_in`-style operations (`add_shards(con, ...)`), never queried by the caller.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from . import descriptor
from .errors import ManifestError

MANIFEST = "manifest.sqlite"


@dataclass(frozen=True)
class Shard:
    shard_id: int
    table_name: str
    path: str  # relative to the buffer root
    rows: int
    tokens: int
    bytes: int
    sha256: str
    key: str | None
    added_seq: int
    removed_seq: int | None


@dataclass(frozen=True)
class NewShard:
    """A written, fsynced file waiting for its manifest row."""

    table_name: str
    path: str
    rows: int
    tokens: int
    bytes: int
    sha256: str
    key: str | None = None
    finite: bool = False  # a rollouts shard whose floats `Buffer.commit` checked finite (recorded in `finite`)


class Catalog(ABC):
    """What a buffer asks of its catalog. `con` is the connection a `transaction()` yields: pass it
    back to the operations that run inside that transaction, and nothing else."""

    root: str
    path: str  # where the catalog is, for messages (a file, or a redacted DSN)
    read_only: str | None = None  # why it could only be opened read-only, else None
    store = None  # the object store of the buffer's shards (storage/store.py), None: in its folder
    multi_host = False  # writers on other hosts: host-local locks and pids prove nothing, intents do

    # ---- the session ---------------------------------------------------------------------------
    @abstractmethod
    def close(self) -> None: ...
    @abstractmethod
    def require_writable(self) -> None:
        """Raise `CatalogReadOnly` (one line) when the catalog could only be opened read-only."""
    @abstractmethod
    def transaction(self) -> AbstractContextManager[Any]:
        """One write transaction, serialised against every other writer; yields its `con`."""

    # ---- commits and shards ------------------------------------------------------------------
    @abstractmethod
    def new_commit(self, con, kind: str, detail: dict | None = None) -> int:
        """Inside `con`: the next snapshot number, its commit row made."""
    @abstractmethod
    def latest_seq(self) -> int: ...
    @abstractmethod
    def commit_log(self, upto: int) -> list[tuple]:
        """(seq, created_at, kind, detail, host) of every commit up to `upto`."""
    @abstractmethod
    def add_shards(self, con, seq: int, shards: list[NewShard]) -> list[int]:
        """Inside `con`: rows for `shards`; a path another writer committed first: FileExistsError."""
    @abstractmethod
    def shards(self, table: str | None = None, seq: int | None = None, after: int | None = None) -> list[Shard]:
        """Shards visible at snapshot `seq` (latest when None), in commit order; with `after`, only
        those added by a commit after it (an index range: what a reader of `after` has not seen)."""
    @abstractmethod
    def table_stamp(self, table: str, seq: int) -> tuple:
        """A value that changes whenever `table`'s shards visible at snapshot `seq` do: two snapshots
        with equal stamps list the same shards (index look-ups, not a listing)."""
    @abstractmethod
    def record_schemas(self, con, rows: list[tuple[int, str]], bodies: dict[str, str]) -> None:
        """Inside `con`: (shard_id, schema_id) of each new shard and each schema_id's body."""
    @abstractmethod
    def shard_schemas(self, ids: list[int]) -> dict[int, str]:
        """{shard_id: its recorded schema, hex of the serialised Arrow schema} of those of `ids` that have one."""
    @abstractmethod
    def record_shard_keys(self, con, rows: list[tuple[int, str]]) -> None:
        """Inside `con`: (shard_id, key) of each key a shard merged from several keys holds."""
    @abstractmethod
    def shard_keys(self, ids: list[int]) -> dict[int, list[str]]:
        """{shard_id: its keys} of those of `ids` merged from several keys (their own `key` is null)."""
    @abstractmethod
    def newest_shard_ids(self, table: str, seq: int) -> set[int] | None:
        """Ids of the `table` shards visible at `seq` that may hold its newest row by `created_at`
        (a superset; None: no time index, every shard may)."""
    @abstractmethod
    def merge_targets(self, paths: list[str]) -> set[str]:
        """Those of `paths` (rollouts shards) that compaction wrote rows of other shards into."""
    @abstractmethod
    def shards_by_id(self, ids: list[int], con=None) -> list[Shard]: ...
    @abstractmethod
    def live_key_count(self, table: str, key: str, con=None) -> int: ...
    @abstractmethod
    def live_keyed(self, table: str, keys: list[str]) -> list[Shard]: ...
    @abstractmethod
    def live_paths(self, table: str, con=None) -> list[tuple[int, str]]: ...
    @abstractmethod
    def all_paths(self) -> set[str]: ...
    @abstractmethod
    def is_unnamed(self, path: str) -> bool:
        """True when no row (live or retired shard, or a store's object) names `path`."""
    @abstractmethod
    def retire_shards(self, con, seq: int, ids: list[int], release_ids: bool = True) -> int:
        """Inside `con`: retire the live shards `ids` at `seq` (`release_ids`: their rollout and group
        ids too); returns how many were live."""
    @abstractmethod
    def unretire(self, con, shard_id: int, seq: int) -> None:
        """Inside `con`: shard `shard_id`, retired at `seq`, is live again."""
    @abstractmethod
    def retired_paths(self, con, paths: list[str]) -> list[str]:
        """Inside `con`: of rollouts shard `paths`, those no live row names and no move resolves."""
    @abstractmethod
    def committed_since(self, con, table: str, seq: int, key: str) -> list[tuple[str, str]]:
        """Inside `con`: (path, key) of live `table` shards committed after `seq`, under another key
        than `key` that a live curation record names, in shard order."""

    # ---- rollout and group ids, finite checks, moves ----------------------------------------
    @abstractmethod
    def existing_ids(self, rollout_ids: list[str], group_ids: list[str]) -> tuple[set[str], set[str]]: ...
    @abstractmethod
    def rollout_shards(self, rollout_ids: list[str]) -> dict[str, int]:
        """{rollout_id: the live rollouts shard holding it} of those of `rollout_ids` a live shard holds."""
    @abstractmethod
    def register_rollouts(self, con, shard_id: int, pairs: Iterable[tuple[str, str]], groups: Iterable[str]) -> None:
        """Inside `con`: claim the ids; an id already taken: nothing claimed, `CatalogConflict`."""
    @abstractmethod
    def move_ids(self, con, shard_ids: list[int], to: int) -> None:
        """Inside `con`: the rollout and group ids of `shard_ids` now belong to shard `to`."""
    @abstractmethod
    def finite_checked(self, digests: list[str]) -> set[str]: ...
    @abstractmethod
    def moves(self, con=None) -> dict[str, tuple[str, int]]: ...
    @abstractmethod
    def record_moves(self, con, seq: int, moves: list[tuple[str, str, int]]) -> None: ...
    @abstractmethod
    def has_table(self, name: str, con=None) -> bool: ...

    # ---- leases and pins ------------------------------------------------------------------------
    @abstractmethod
    def lease(self, table: str, n: int, consumer: str, group: str = "default",
              ttl: float = 600.0) -> tuple[str, list[Shard]]: ...
    @abstractmethod
    def ack(self, shard_ids: list[int], consumer: str, group: str = "default") -> int: ...
    @abstractmethod
    def ack_paths(self, con, paths: list[str], consumer: str, group: str, now: float) -> list[str]: ...
    @abstractmethod
    def leased_ids(self, con=None) -> set[int]:
        """Shards ever leased (acked or not) in any group."""
    @abstractmethod
    def pin(self, seq: int, ttl: float = 3600.0) -> str: ...
    @abstractmethod
    def unpin(self, pin_id: str) -> None: ...
    @abstractmethod
    def oldest_pinned_seq(self) -> int | None: ...

    # ---- gc and verify ------------------------------------------------------------------------
    @abstractmethod
    def collected_seq(self) -> int: ...
    @abstractmethod
    def retired_rows(self) -> list[tuple[int, str, int]]:
        """(shard_id, path, removed_seq) of every retired shard whose row is still there."""
    @abstractmethod
    def forget_retired(self, con, ids: list[int], removed_seq: int) -> None:
        """Inside `con`: delete the rows `ids` (gc removes their files next); `collected_seq` rises."""
    @abstractmethod
    def verified_ids(self) -> set[int]: ...
    @abstractmethod
    def record_verified(self, shard_ids: list[int]) -> None: ...
    @abstractmethod
    def quarantined(self) -> list[tuple[int, int]]:
        """(shard_id, seq of the quarantine commit that retired it)."""
    @abstractmethod
    def data_marker(self) -> str | None:
        """The identity marker the catalog recorded for its data (None: the embedded manifest)."""

    # ---- the checkpoint index and the consumed ledger --------------------------------------
    @abstractmethod
    def index_checkpoints(self, con, rows: list[tuple]) -> None: ...
    @abstractmethod
    def record_ledger(self, con, seq: int, rows) -> None: ...
    @abstractmethod
    def record_consumed(self, con, run_id: str, version: int, entries: list[dict], checkpoint_shard_id: int,
                        seq: int) -> str | None:
        """Inside the publishing `con`: why checkpoint `version` may not be published, else None."""
    @abstractmethod
    def consumed_by(self, shards: list[str], run_id: str | None = None, con=None,
                    exclude: tuple = ()) -> list[tuple[str, int]]: ...
    @abstractmethod
    def checkpoint_index(self, seq: int | None = None, run_id: str | None = None, version: int | None = None,
                         newest: int = 0, con=None, unpruned: bool = False
                         ) -> tuple[list[tuple], list[tuple[int, str]]]:
        """(index rows by version — `newest` > 0: the highest `newest` alone, newest first; `unpruned`:
        only versions whose files retention kept —, visible checkpoints shards without an index row)."""
    @abstractmethod
    def unindexed_checkpoints(self, seq: int | None = None, con=None) -> list[tuple[int, str]]: ...
    @abstractmethod
    def indexed_through(self, con, shard_id: int | None = None) -> None: ...
    @abstractmethod
    def hold_checkpoint(self, holder: str, version: int, ttl: float) -> None: ...
    @abstractmethod
    def release_checkpoint(self, holder: str) -> None: ...
    @abstractmethod
    def tag_checkpoint(self, version: int, name: str | None) -> None: ...
    @abstractmethod
    def checkpoint_holds(self, con) -> dict[int, str]:
        """{version: holder} of the unexpired holds."""
    @abstractmethod
    def prune_checkpoints(self, con, seq: int, shard_ids: list[int]) -> None: ...
    @abstractmethod
    def pruned_uncollected(self) -> list[tuple[int, str, int]]:
        """(shard_id, path, pruned_seq) of pruned checkpoint versions whose files gc has not removed."""
    @abstractmethod
    def mark_collected(self, shard_ids: list[int]) -> None: ...

    # ---- the step index and the prompt state (issue 49: a step's work flat in the run's history) --
    @abstractmethod
    def index_steps(self, con, rows: list[tuple], times: list[tuple] = ()) -> None:
        """In the commit that adds rollouts / prompt_selections shards: (shard_id, table, run, step range) rows
        and the rollouts shards' (shard_id, newest created_at in µs)."""
    @abstractmethod
    def step_shard_ids(self, table: str, run_id: str, first: int | None, last: int | None,
                       seq: int | None = None, con=None) -> set[int]:
        """The shards of `table` that may hold run `run_id`'s steps in [first, last], by index."""
    @abstractmethod
    def record_prompt_state(self, con, seq: int, new_ids: list[int], groups: dict, selections: dict) -> None:
        """In the commit that adds them: fold new groups and selections into their runs' prompt state."""
    @abstractmethod
    def forget_prompt_state(self, con) -> None:
        """In a commit that retires or restores rows other than by compaction: no run's state is kept."""
    @abstractmethod
    def prompt_state(self, run_id: str, prompt_ids: list[str] | None = None) -> tuple[tuple, dict] | None:
        """A run's kept prompt state (its selection row, {prompt: state}), or None when not kept."""
    @abstractmethod
    def pin_shards(self, seq: int, ttl: float = 3600.0) -> str:
        """A pin that keeps the shards visible at `seq`, not pruned checkpoints' files (a DuckDB session's)."""
    @abstractmethod
    def oldest_checkpoint_pin(self) -> int | None:
        """The oldest snapshot pinned by a reader that may load a checkpoint (`pin_shards` pins left out)."""

    # ---- write intents (PostgreSQL's; nothing to do for the embedded manifest) -------------------
    def intend(self, paths: list[str]) -> None:
        """Intents on `paths` before their first byte (gc of every host leaves them alone)."""

    def holding(self, path: str) -> AbstractContextManager[None]:
        """While a working file or folder under tmp/ is in use: an intent on it (renewed while held)."""
        return nullcontext()

    def commit_ended(self, rolled_back: bool) -> None:
        """The commit in progress ended (`rolled_back`: before COMMIT was sent, its files removed)."""

    def may_replace(self, path: str) -> bool:
        """A file found at `path` may be replaced by this writer (an orphan of a crashed one)."""
        return self.is_unnamed(path)

    def protected(self, paths: list[str]) -> set[str]:
        """Those of `paths` that a row names or a live intent holds."""
        named = self.all_paths()
        return {p for p in paths if p in named}

    @contextmanager
    def owning(self, path: str) -> Iterator[bool]:
        """gc's hold on an unnamed `path` it means to remove: True when it may."""
        yield self.is_unnamed(path)

    def drop_expired_intents(self) -> int:
        return 0

    # ---- a store's objects that are not shards (a checkpoint's files) --------------------------
    def record_objects(self, con, seq: int, objects: list[tuple[str, str, int]]) -> None:
        """Inside the publishing `con`: name `objects` ((path, sha256, bytes)); a store's catalog's."""

    def objects_under(self, prefix: str) -> list[tuple[str, str, int]]:
        return []


def holding(catalog: Catalog, relpath: str) -> AbstractContextManager[None]:
    """While a working file or folder under tmp/ (`relpath`) is in use: `catalog.holding(relpath)`
    (PostgreSQL: an intent, so gc of any host leaves it alone; the embedded manifest: nothing, its
    gc judges tmp/ by its owner's pid)."""
    return catalog.holding(relpath)


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
    from .manifest import Manifest

    return Manifest(root, create=create)
