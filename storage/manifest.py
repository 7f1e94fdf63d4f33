"""The SQLite manifest: the single commit point of a buffer.

Invariants:
- Every change is one transaction (`BEGIN IMMEDIATE`) that inserts one `commits` row; its `seq` is
  the snapshot number. A shard is visible at snapshot S iff `added_seq <= S` and
  (`removed_seq` is null or `removed_seq > S`).
- `rollout_ids` and `group_ids` hold every rollout and group of the live `rollouts` shards; their
  primary keys make uniqueness across the buffer hold even between concurrent appenders.
- A lease is held by one consumer at a time per consumer group; an acked shard is never leased again
  in that group; an expired unacked lease returns the shard to the pool.
- WAL mode with synchronous=FULL: a committed transaction survives kill -9 and power loss. Pins
  are the exception (`pin`, `unpin`: synchronous=NORMAL, no fsync of their own): a pin protects a
  live reader's files from gc, and a power loss that could lose it ends that reader too; it
  survives kill -9 like any commit (the WAL is in the file system at COMMIT), is visible to other
  processes at once, and the next durable commit flushes it with the WAL.
- `finite` (made by the first commit of a rollouts shard): the sha256 of every rollouts file whose
  floats `Buffer.commit` checked finite before writing it; content-addressed, so a file that hashes
  to one of them (a reader verifies the hash before committing anything from it) needs no second
  NaN check. Rows are only ever added.
- `moved` (made by the first compaction or migration that retires a rollouts shard; the manifest
  is then schema version 2, which older rollstores refuse to open): one row per retired rollouts
  shard whose rows were rewritten, in order, into another shard: row i of `path` is row
  `row_offset + i` of `to_path` from snapshot `seq` on. Rows are only ever added, in the commit
  that retires `path`, so a reference to `path` (a thin curated shard's) resolves by following
  the chain to the shard live in the reader's snapshot; nothing that names a curated shard (the
  consumed ledger, leases, pins, the curation's record) changes.
- Errors leave as the catalog's own (`errors.CatalogError` kinds, translated by `SqliteConnection`
  from sqlite3's at the connection), never as sqlite3's.

`Manifest` is the SQLite sibling of `catalog_pg.PgManifest` under `catalog_sql.SqlCatalog`: here is
what only SQLite does (opening, read-only fallback, `BEGIN IMMEDIATE`, `lastrowid`, savepoints); the
shared queries are in `catalog_sql.py`, the operation list in `catalog.Catalog`.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import time
import urllib.parse
from contextlib import contextmanager
from typing import Iterable, Iterator

from .catalog import MANIFEST, NewShard, Shard
from .catalog_sql import CHECKPOINT_COLS, CHECKPOINT_DDL, MOVED_DDL, REQUIRED_TABLES, SqlCatalog
from .dialect import SQLITE
from .errors import CatalogBusy, CatalogConflict, CatalogDamaged, CatalogError, CatalogReadOnly, ManifestError, NotABuffer

__all__ = ["MANIFEST", "CHECKPOINT_COLS", "CHECKPOINT_DDL", "MOVED_DDL", "Manifest", "ManifestReadOnly", "NewShard",
           "Shard"]

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS commits (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at REAL NOT NULL,
    kind TEXT NOT NULL,
    detail TEXT
);
CREATE TABLE IF NOT EXISTS shards (
    shard_id INTEGER PRIMARY KEY AUTOINCREMENT,
    table_name TEXT NOT NULL,
    path TEXT NOT NULL UNIQUE,
    rows INTEGER NOT NULL,
    tokens INTEGER NOT NULL DEFAULT 0,
    bytes INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    key TEXT,
    added_seq INTEGER NOT NULL,
    removed_seq INTEGER
);
CREATE INDEX IF NOT EXISTS shards_by_table ON shards (table_name, added_seq);
CREATE INDEX IF NOT EXISTS shards_by_removal ON shards (table_name, removed_seq);
CREATE INDEX IF NOT EXISTS shards_by_key ON shards (table_name, key);
CREATE TABLE IF NOT EXISTS rollout_ids (
    rollout_id TEXT PRIMARY KEY, group_id TEXT NOT NULL, shard_id INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS group_ids (
    group_id TEXT PRIMARY KEY, shard_id INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS leases (
    consumer_group TEXT NOT NULL,
    shard_id INTEGER NOT NULL,
    consumer TEXT NOT NULL,
    lease_id TEXT NOT NULL,
    expires_at REAL NOT NULL,
    acked_at REAL,
    PRIMARY KEY (consumer_group, shard_id)
);
CREATE TABLE IF NOT EXISTS pins (pin_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, expires_at REAL NOT NULL);
"""

# Where the rows of retired rollouts shards went (see the module invariants); made on first use.
# The sha256 of every rollouts file whose floats were checked finite when it was committed; made on
# first use (a manifest without it: nothing recorded, every shard is checked where it is read).
FINITE_DDL = "CREATE TABLE IF NOT EXISTS finite (sha256 TEXT PRIMARY KEY) WITHOUT ROWID"
# The manifest format versions this rollstore reads: 2 adds `moved`.
MANIFEST_VERSIONS = ("1", "2")


# SQLite errors that mean "cannot write here" (a full disk, a read-only mount or files one may not
# write): a reader then opens the manifest read-only instead. Errors that mean "this is not a
# database" or "it is damaged" are reported as such, never retried.
_CANNOT_WRITE = ("SQLITE_IOERR", "SQLITE_CANTOPEN", "SQLITE_READONLY", "SQLITE_FULL", "SQLITE_PERM")
_DAMAGED = ("SQLITE_NOTADB", "SQLITE_CORRUPT")

DAMAGED_ADVICE = ("restore manifest.sqlite from a backup (it alone records what is committed; the "
                  "shards cannot rebuild it)")


def _errorname(exc: BaseException) -> str:
    return getattr(exc, "sqlite_errorname", "") or ""


def damaged(path: str, exc: BaseException | str) -> ManifestError:
    """The one-line error for a manifest that is not a rollstore manifest, or is damaged."""
    return ManifestError(f"{path}: not a rollstore manifest or damaged ({str(exc).strip() or 'unreadable'}); "
                         f"{DAMAGED_ADVICE}")


def _why_not_writable(root: str, exc: BaseException) -> str:
    """The reason a manifest could not be opened for writing, in the words of the disk."""
    try:
        st = os.statvfs(root)
        if st.f_flag & os.ST_RDONLY:
            return "read-only file system"
        if st.f_bavail == 0 or _errorname(exc).startswith("SQLITE_FULL"):
            return f"no space left on device; {exc}"
    except OSError:
        pass
    if not os.access(root, os.W_OK) or not os.access(os.path.join(root, MANIFEST), os.W_OK):
        return f"no permission to write; {exc}"
    return str(exc)



ManifestReadOnly = CatalogReadOnly  # (its name here before the catalog had errors of its own)
_BUSY = ("SQLITE_BUSY", "SQLITE_LOCKED")


def catalog_error(path: str, exc: sqlite3.Error) -> CatalogError:
    """The catalog's own error for a sqlite3 one (one line): a busy or locked database, a constraint
    violated, a damaged file (with what to do), or any other failure of the manifest."""
    if isinstance(exc, sqlite3.IntegrityError):
        return CatalogConflict(f"manifest: {exc}")
    if isinstance(exc, sqlite3.OperationalError):
        busy = _errorname(exc).startswith(_BUSY) or "database is locked" in str(exc)
        return (CatalogBusy if busy else CatalogError)(f"manifest: {exc}")
    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.ProgrammingError):
        return CatalogDamaged(f"{path}: damaged ({' '.join(str(exc).split()) or 'unreadable'}); {DAMAGED_ADVICE}")
    return CatalogError(f"manifest: {exc}")


class SqliteConnection:
    """The embedded manifest's connection: sqlite3's (`raw`), whose errors leave it as the catalog's
    own (`catalog_error`)."""

    def __init__(self, raw: sqlite3.Connection, path: str):
        self.raw = raw
        self.path = path

    def execute(self, sql: str, params=()) -> sqlite3.Cursor:
        try:
            return self.raw.execute(sql, params)
        except sqlite3.Error as exc:
            raise catalog_error(self.path, exc) from exc

    def executemany(self, sql: str, seq_of_params) -> sqlite3.Cursor:
        try:
            return self.raw.executemany(sql, seq_of_params)
        except sqlite3.Error as exc:
            raise catalog_error(self.path, exc) from exc

    def close(self) -> None:
        self.raw.close()

    def set_trace_callback(self, callback) -> None:
        self.raw.set_trace_callback(callback)


class Manifest(SqlCatalog):
    """A connection to one buffer's manifest. One per thread; cheap to open.

    Opening tries read-write (WAL, synchronous=FULL). When the disk is full, the mount read-only or
    the files not writable by this user, it opens the manifest read-only (`read_only` is then the
    reason): reads work, and any write raises `CatalogReadOnly` naming the reason. A file that is
    not a rollstore manifest, or is damaged, is one `ManifestError` saying so and what to do. Its
    connection (`SqliteConnection`) raises the catalog's own errors, never sqlite3's."""

    dialect = SQLITE

    def __init__(self, root: str, create: bool = False):
        path = os.path.join(root, MANIFEST)
        if not create and not os.path.exists(path):
            raise NotABuffer(f"{root}: not a rollstore buffer (no {MANIFEST}); create it with `rollstore init {root}` "
                             f"(in Python: rollstore.open({root!r}, create=True))")
        self.root = root
        self.path = path
        self.read_only: str | None = None
        if os.path.exists(path) and os.path.getsize(path) == 0:
            raise damaged(path, "an empty file")  # never made into a new, empty manifest over shards
        try:
            self.con = SqliteConnection(self._open_read_write(path, create), path)
        except sqlite3.DatabaseError as exc:
            if _errorname(exc).startswith(_DAMAGED) or not _errorname(exc).startswith(_CANNOT_WRITE) or create:
                if _errorname(exc).startswith(_DAMAGED) or not isinstance(exc, sqlite3.OperationalError):
                    raise damaged(path, exc) from None
                raise
            self.con = SqliteConnection(self._open_read_only(path, exc), path)
            self.read_only = _why_not_writable(root, exc)
        if create:
            with self.transaction():
                for statement in filter(str.strip, _DDL.split(";")):
                    self.con.execute(statement)
                self.con.execute(SQLITE.insert_ignore("meta", ("key", "value")), ("schema_version", "1"))
        elif self.read_only is not None:
            self._check_is_rollstore(self.con)

    def _open_read_write(self, path: str, create: bool) -> sqlite3.Connection:
        """Connect, check that this is a rollstore manifest (before anything is written to the
        file: a foreign database is never switched to WAL), then set WAL and synchronous=FULL."""
        con = sqlite3.connect(path, timeout=60.0, isolation_level=None, check_same_thread=False)
        try:
            con.execute("PRAGMA busy_timeout=60000")
            con.execute("SELECT count(*) FROM sqlite_master").fetchone()  # opens the WAL index
            self._check_is_rollstore(con, new_ok=create)
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=FULL")
        except BaseException:
            con.close()
            raise
        return con

    @staticmethod
    def _open_read_only(path: str, why: BaseException) -> sqlite3.Connection:
        """`mode=ro`; when SQLite cannot even create its WAL index (a read-only folder, a full
        disk), `immutable=1`, which reads the database file alone: only correct when no WAL holds
        commits not yet in it, so that case is refused rather than read stale."""
        uri = "file:" + urllib.parse.quote(os.path.abspath(path))
        for mode in ("mode=ro", "immutable=1"):
            if mode == "immutable=1":
                wal = path + "-wal"
                if os.path.exists(wal) and os.path.getsize(wal) > 0:
                    raise ManifestError(
                        f"{path}: cannot be read without writing ({why}), and {wal} holds commits not yet "
                        "in the manifest file; free space or make the folder writable, then read again")
            try:
                con = sqlite3.connect(f"{uri}?{mode}", uri=True, timeout=60.0, isolation_level=None,
                                      check_same_thread=False)
            except sqlite3.DatabaseError:
                continue
            try:
                con.execute("PRAGMA busy_timeout=60000")
                con.execute("SELECT count(*) FROM sqlite_master").fetchone()
                return con
            except sqlite3.DatabaseError as exc:
                con.close()
                if _errorname(exc).startswith(_DAMAGED):
                    raise damaged(path, exc) from None
        raise ManifestError(f"{path}: cannot be opened, not even read-only ({why})")

    def _check_is_rollstore(self, con: sqlite3.Connection, new_ok: bool = False) -> None:
        """Raise one line unless this is a rollstore manifest (`new_ok`: or a database with no table)."""
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if new_ok and not tables:
                return
            missing = [t for t in REQUIRED_TABLES if t not in tables]
            if missing:
                raise damaged(self.path, f"no table {missing[0]!r}")
            row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise damaged(self.path, exc) from None
        if row is None:
            raise damaged(self.path, "no schema_version")
        if row[0] not in MANIFEST_VERSIONS:
            raise ManifestError(f"{self.path}: manifest schema version {row[0]!r}, this rollstore reads versions "
                                f"{' and '.join(MANIFEST_VERSIONS)}; use the rollstore that wrote it")

    def close(self) -> None:
        self.con.close()

    @contextmanager
    def transaction(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction (`BEGIN IMMEDIATE`). `durable=False`: its COMMIT does not wait for
        the disk (synchronous=NORMAL for this transaction only; see the module invariants)."""
        self.require_writable()
        if not durable:
            self.con.execute("PRAGMA synchronous=NORMAL")
        try:
            self.con.execute("BEGIN IMMEDIATE")
            try:
                yield self.con
            except BaseException:
                self.con.execute("ROLLBACK")
                raise
            else:
                self.con.execute("COMMIT")
        finally:
            if not durable:
                self.con.execute("PRAGMA synchronous=FULL")

    def commit_log(self, upto: int) -> list[tuple]:
        """(seq, created_at, kind, detail, host) of every commit up to `upto`; host is None here (one
        machine writes an embedded manifest). The `commits` view of `rollstore sql` (docs/usage.md)."""
        return [(*row, None) for row in self.con.execute(
            "SELECT seq, created_at, kind, detail FROM commits WHERE seq <= ? ORDER BY seq", (upto,)).fetchall()]

    def new_commit(self, con: sqlite3.Connection, kind: str, detail: dict | None = None) -> int:
        cur = con.execute(
            "INSERT INTO commits (created_at, kind, detail) VALUES (?, ?, ?)",
            (time.time(), kind, json.dumps(detail or {}, sort_keys=True)),
        )
        return int(cur.lastrowid)

    def add_shards(self, con: sqlite3.Connection, seq: int, shards: list[NewShard]) -> list[int]:
        """Insert the rows of `shards` inside the transaction `con`. A path that another writer
        committed first (two identical runs racing) raises FileExistsError naming it, the error a
        link onto a committed file raises, so callers handle both races the same way."""
        ids = []
        for s in shards:
            try:
                cur = con.execute(
                    "INSERT INTO shards (table_name, path, rows, tokens, bytes, sha256, key, added_seq)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (s.table_name, s.path, s.rows, s.tokens, s.bytes, s.sha256, s.key, seq),
                )
            except CatalogConflict:
                if self.is_unnamed(s.path):
                    raise
                raise FileExistsError(errno.EEXIST, "already committed by another writer",
                                      os.path.join(self.root, s.path)) from None
            ids.append(int(cur.lastrowid))
        checked = [(sh.sha256,) for sh in shards if sh.finite]
        if checked:
            con.execute(FINITE_DDL)
            con.executemany(SQLITE.insert_ignore("finite", ("sha256",)), checked)
        return ids

    def finite_checked(self, digests: list[str]) -> set[str]:
        """Which of these sha256 name a rollouts file that was checked finite when it was committed
        (content-addressed: a file that hashes to one of them holds no NaN or infinity)."""
        if not digests or not self.has_table("finite"):
            return set()
        found: set[str] = set()
        for cond, args in SQLITE.in_list("sha256", digests):
            found.update(r[0] for r in self.con.execute(f"SELECT sha256 FROM finite WHERE {cond}", args))
        return found

    def ack_paths(self, con: sqlite3.Connection, paths: list[str], consumer: str, group: str, now: float) -> list[str]:
        """Inside the transaction `con`: ack the open leases of `consumer` (in `group`) on the shards at
        `paths`; returns the paths whose lease `consumer` did not hold (nothing is acked for them)."""
        missing = []
        for path in paths:
            cur = con.execute(
                "UPDATE leases SET acked_at = ? WHERE consumer_group = ? AND consumer = ? AND acked_at IS NULL "
                "AND shard_id = (SELECT shard_id FROM shards WHERE path = ?)",
                (now, group, consumer, path),
            )
            if cur.rowcount != 1:
                missing.append(path)
        return missing

    def record_ledger(self, con, seq: int, rows: list[tuple[int, int, str, list[dict]]]) -> None:
        """Inside the transaction `con`: the consumed ledger of indexed versions, each row (checkpoints
        shard id, version, run, its `consumed` entries). The embedded manifest's; a PostgreSQL
        catalog records its ledger as it publishes (`record_consumed`) and ignores this."""
        con.executemany("INSERT INTO consumed (run_id, shard, curation_id, version, checkpoint_shard_id, seq) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        [(run, e["shard"], e.get("curation_id"), int(v), int(i), int(seq))
                         for i, v, run, entries in rows for e in entries])

    def register_rollouts(self, con: sqlite3.Connection, shard_id: int, pairs: Iterable[tuple[str, str]],
                          groups: Iterable[str]) -> None:
        """Claim the ids: `pairs` of (rollout_id, group_id) and the distinct `groups`, both consumed
        lazily (a big append never holds all its ids as Python objects). On a conflict undo the
        partial claim (so a lookup sees only others' ids) and raise `CatalogConflict`."""
        con.execute("SAVEPOINT register")
        try:
            self._claim_ids(con, shard_id, pairs, groups)
        except CatalogConflict:
            con.execute("ROLLBACK TO SAVEPOINT register")
            con.execute("RELEASE SAVEPOINT register")
            raise
        con.execute("RELEASE SAVEPOINT register")

    # ---- leases ----------------------------------------------------------------------------
    def ack(self, shard_ids: list[int], consumer: str, group: str = "default") -> int:
        """Ack shards this consumer holds; returns how many were acked (0 if the lease was lost)."""
        with self.transaction() as con:
            done = 0
            for sid in shard_ids:
                cur = con.execute(
                    "UPDATE leases SET acked_at = ? WHERE consumer_group = ? AND shard_id = ? "
                    "AND consumer = ? AND acked_at IS NULL",
                    (time.time(), group, sid, consumer),
                )
                done += cur.rowcount
        return done

    def _pin_transaction(self):
        """The transaction of a pin or an unpin: one that does not wait for the disk (module invariants)."""
        return self.transaction(durable=False)

    def record_consumed(self, con, run_id: str, version: int, entries: list[dict], checkpoint_shard_id: int,
                        seq: int) -> str | None:
        """Inside the publishing transaction, after the new version was indexed with its ledger
        (`record_ledger`, called by the index): why it may not be published (another live
        checkpoint has `version`; a shard of `entries` was already trained into a live checkpoint of
        `run_id`), else None."""
        if con.execute("SELECT 1 FROM checkpoint_index c JOIN shards s ON s.shard_id = c.shard_id "
                       "WHERE s.removed_seq IS NULL AND c.version = ? AND c.shard_id <> ? LIMIT 1",
                       (int(version), int(checkpoint_shard_id))).fetchone():
            return f"checkpoint version {version} already exists"
        shards = [e["shard"] for e in entries]
        taken = dict(self.consumed_by(shards, run_id, con, (int(checkpoint_shard_id),)))
        dup = [s for s in shards if s in taken]
        if dup:
            return f"checkpoint v{version}: shard {dup[0]} was already trained into v{taken[dup[0]]} of run {run_id!r}"
        return None

    def data_marker(self) -> str | None:
        """None: the folder that holds the embedded manifest is its data folder."""
        return None
