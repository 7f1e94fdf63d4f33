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
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import time
import urllib.parse
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

from .errors import ManifestError, NotABuffer

MANIFEST = "manifest.sqlite"
SHARDS_PIN = "shards-"  # the id prefix of a pin that keeps shards' files only (`Manifest.pin_shards`)

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
MOVED_DDL = ("CREATE TABLE IF NOT EXISTS moved (path TEXT PRIMARY KEY, to_path TEXT NOT NULL, "
             "row_offset BIGINT NOT NULL, seq BIGINT NOT NULL)")
# The checkpoint index (made by the first checkpoint a rollstore with it publishes; `learner.checkpoint`):
# one row per `checkpoints` shard, the row its file holds, so that listing, the newest checkpoint of
# a run and a version's lineage are catalog queries, not a read of every checkpoint file.
# `pruned_seq`: the commit that gave the version's files up (`learner.retention`; the row stays:
# lineage, ledger); `tag`: a user's name for it, which keeps its files; `collected`: 1 once gc removed
# the files of a pruned version. `checkpoint_holds`: versions
# a live process (a following learner or generator) still needs, until `expires_at`.
CHECKPOINT_DDL = (
    "CREATE TABLE IF NOT EXISTS checkpoint_index (shard_id BIGINT PRIMARY KEY, version BIGINT NOT NULL, "
    "run_id TEXT NOT NULL, parent_version BIGINT, path TEXT NOT NULL, created_us BIGINT NOT NULL, "
    "consumed TEXT NOT NULL, metrics TEXT NOT NULL, pruned_seq BIGINT, tag TEXT, collected BIGINT)",
    "CREATE INDEX IF NOT EXISTS checkpoint_index_by_run ON checkpoint_index (run_id, version)",
    "CREATE INDEX IF NOT EXISTS checkpoint_index_by_version ON checkpoint_index (version)",
    "CREATE TABLE IF NOT EXISTS checkpoint_holds (holder TEXT PRIMARY KEY, version BIGINT NOT NULL, "
    "expires_at DOUBLE PRECISION NOT NULL)",
    # the consumed ledger, one row per (version, shard) (a PostgreSQL catalog has it from schema version 2;
    # the embedded manifest makes it with the index, filled for every indexed version)
    "CREATE TABLE IF NOT EXISTS consumed (run_id TEXT NOT NULL, shard TEXT NOT NULL, curation_id TEXT, "
    "version BIGINT NOT NULL, checkpoint_shard_id BIGINT NOT NULL, seq BIGINT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS consumed_by_run ON consumed (run_id, shard)",
    "CREATE INDEX IF NOT EXISTS consumed_by_shard ON consumed (shard)",
)
CHECKPOINT_COLS = ("shard_id", "version", "run_id", "parent_version", "path", "created_us", "consumed", "metrics",
                   "pruned_seq", "tag")
# The step index (made by the first commit of a `rollouts` or `prompt_selections` shard; `Buffer.commit`):
# one row per (shard, run_id) of those tables, the range of steps the shard's rows of that run hold, so
# that "which shards hold run R's step S" is an index lookup, not a read of every shard. Meta's
# `steps_indexed_through`: every shard of those tables with a lower or equal id has its rows here.
STEP_INDEXED = ("rollouts", "prompt_selections")
STEP_INDEX_DDL = (
    "CREATE TABLE IF NOT EXISTS shard_steps (shard_id BIGINT NOT NULL, table_name TEXT NOT NULL, run_id TEXT, "
    "step_min BIGINT, step_max BIGINT)",
    "CREATE INDEX IF NOT EXISTS shard_steps_by_run ON shard_steps (table_name, run_id, step_max)",
    "CREATE INDEX IF NOT EXISTS shard_steps_by_shard ON shard_steps (shard_id)",
)
# Each prompt's group history in a run and each run's newest prompt selection, kept as rows are committed
# (`storage.prompt_state`; made by the first commit of rollouts or selections rows): pre-rollout prompt
# selection reads them instead of the run's history.
PROMPT_STATE_DDL = (
    "CREATE TABLE IF NOT EXISTS prompt_state (run_id TEXT NOT NULL, prompt_id TEXT NOT NULL, groups BIGINT NOT NULL, "
    "streak BIGINT NOT NULL, newest_step BIGINT NOT NULL, newest_group TEXT NOT NULL, "
    "newest_all_correct BIGINT NOT NULL, PRIMARY KEY (run_id, prompt_id))",
    "CREATE TABLE IF NOT EXISTS prompt_state_runs (run_id TEXT PRIMARY KEY, tracked BIGINT NOT NULL, "
    "sel_step BIGINT, sel_position BIGINT, explore_easy DOUBLE PRECISION, explore_hard DOUBLE PRECISION, "
    "seq BIGINT NOT NULL)",
)
# The manifest format versions this rollstore reads: 2 adds `moved`.
SCHEMA_VERSIONS = ("1", "2")


def _visible(seq: int | None) -> tuple[str, list]:
    """The condition (on shards `s`) and arguments of "visible at snapshot `seq`" (None: live now)."""
    if seq is None:
        return "s.removed_seq IS NULL", []
    return "s.added_seq <= ? AND (s.removed_seq IS NULL OR s.removed_seq > ?)", [seq, seq]


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


_SHARD_COLS = "shard_id, table_name, path, rows, tokens, bytes, sha256, key, added_seq, removed_seq"


REQUIRED_TABLES = ("meta", "commits", "shards", "rollout_ids", "group_ids", "leases", "pins")

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


class ManifestReadOnly(ManifestError):
    """A write was asked of a manifest that could only be opened read-only."""


class Manifest:
    """A connection to one buffer's manifest. One per thread; cheap to open.

    Opening tries read-write (WAL, synchronous=FULL). When the disk is full, the mount read-only or
    the files not writable by this user, it opens the manifest read-only (`read_only` is then the
    reason): reads work, and any write raises `ManifestReadOnly` naming the reason. A file that is
    not a rollstore manifest, or is damaged, is one `ManifestError` saying so and what to do."""

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
            self.con = self._open_read_write(path, create)
        except sqlite3.DatabaseError as exc:
            if _errorname(exc).startswith(_DAMAGED) or not _errorname(exc).startswith(_CANNOT_WRITE) or create:
                if _errorname(exc).startswith(_DAMAGED) or not isinstance(exc, sqlite3.OperationalError):
                    raise damaged(path, exc) from None
                raise
            self.con = self._open_read_only(path, exc)
            self.read_only = _why_not_writable(root, exc)
        if create:
            with self.transaction():
                for statement in filter(str.strip, _DDL.split(";")):
                    self.con.execute(statement)
                self.con.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', '1')")
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
        if row[0] not in SCHEMA_VERSIONS:
            raise ManifestError(f"{self.path}: manifest schema version {row[0]!r}, this rollstore reads versions "
                                f"{' and '.join(SCHEMA_VERSIONS)}; use the rollstore that wrote it")

    def close(self) -> None:
        self.con.close()

    def require_writable(self) -> None:
        """Raise `ManifestReadOnly` (one line) when this manifest could only be opened read-only."""
        if self.read_only is not None:
            raise ManifestReadOnly(f"{self.path}: cannot be written ({self.read_only}; opened read-only); "
                                   "nothing was written")

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

    # ---- commits and snapshots -------------------------------------------------------------
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

    def latest_seq(self) -> int:
        row = self.con.execute("SELECT coalesce(max(seq), 0) FROM commits").fetchone()
        return int(row[0])

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
            except sqlite3.IntegrityError:
                if self.is_unnamed(s.path):
                    raise
                raise FileExistsError(errno.EEXIST, "already committed by another writer",
                                      os.path.join(self.root, s.path)) from None
            ids.append(int(cur.lastrowid))
        checked = [(sh.sha256,) for sh in shards if sh.finite]
        if checked:
            con.execute(FINITE_DDL)
            con.executemany("INSERT OR IGNORE INTO finite (sha256) VALUES (?)", checked)
        return ids

    def finite_checked(self, digests: list[str]) -> set[str]:
        """Which of these sha256 name a rollouts file that was checked finite when it was committed
        (content-addressed: a file that hashes to one of them holds no NaN or infinity)."""
        if not digests or self.con.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'finite'").fetchone() is None:
            return set()
        found: set[str] = set()
        for i in range(0, len(digests), 500):
            chunk = digests[i:i + 500]
            found.update(r[0] for r in self.con.execute(
                f"SELECT sha256 FROM finite WHERE sha256 IN ({', '.join('?' * len(chunk))})", chunk))
        return found

    def shards(self, table: str | None = None, seq: int | None = None) -> list[Shard]:
        """Shards visible at snapshot `seq` (latest when None), in commit order."""
        seq = self.latest_seq() if seq is None else seq
        sql = (
            f"SELECT {_SHARD_COLS} FROM shards WHERE added_seq <= ? "
            "AND (removed_seq IS NULL OR removed_seq > ?)"
        )
        args: list = [seq, seq]
        if table is not None:
            sql += " AND table_name = ?"
            args.append(table)
        sql += " ORDER BY added_seq, shard_id"
        return [Shard(*row) for row in self.con.execute(sql, args)]

    def live_key_count(self, table: str, key: str, con: sqlite3.Connection | None = None) -> int:
        """Live shards of `table` under `key` (e.g. a curation's record), read inside `con` when given."""
        return int((con or self.con).execute(
            "SELECT count(*) FROM shards WHERE table_name = ? AND key = ? AND removed_seq IS NULL", (table, key),
        ).fetchone()[0])

    def live_keyed(self, table: str, keys: list[str]) -> list[Shard]:
        """The live shards of `table` under any of `keys` (or under none: older shards), in shard order."""
        out: list[Shard] = []
        for i in range(0, max(1, len(keys)), 500):
            chunk = keys[i:i + 500]
            marks = ", ".join("?" * len(chunk))
            out += [Shard(*r) for r in self.con.execute(
                f"SELECT {_SHARD_COLS} FROM shards WHERE table_name = ? AND removed_seq IS NULL "
                f"AND ({'key IN (' + marks + ') OR ' if chunk else ''}key IS NULL) ORDER BY shard_id", [table, *chunk])]
        return sorted({s.shard_id: s for s in out}.values(), key=lambda s: s.shard_id)

    def live_paths(self, table: str, con: sqlite3.Connection | None = None) -> list[tuple[int, str]]:
        """(shard_id, path) of the live shards of `table`, in shard order, read inside `con` when given."""
        return [(int(i), str(p)) for i, p in (con or self.con).execute(
            "SELECT shard_id, path FROM shards WHERE table_name = ? AND removed_seq IS NULL ORDER BY shard_id",
            (table,),
        )]

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

    def shards_by_id(self, ids: list[int]) -> list[Shard]:
        rows = {r[0]: Shard(*r) for r in self.con.execute(
            f"SELECT {_SHARD_COLS} FROM shards WHERE shard_id IN ({','.join('?' * len(ids))})", ids)}
        return [rows[i] for i in ids]

    def is_unnamed(self, path: str) -> bool:
        """True when no shard row (live or retired) names `path`: a file there is an orphan."""
        return self.con.execute("SELECT 1 FROM shards WHERE path = ? LIMIT 1", (path,)).fetchone() is None

    def all_paths(self) -> set[str]:
        return {row[0] for row in self.con.execute("SELECT path FROM shards")}

    # ---- rows of retired rollouts shards, moved into others (compaction, migration) -----------
    def moves(self, con=None) -> dict[str, tuple[str, int]]:
        """{retired rollouts shard path: (the path its rows were moved to, their first row there)};
        empty for a manifest no compaction has moved rows in (no `moved` table). Read inside `con`
        when given."""
        con = con or self.con
        if not self._has_moved(con):
            return {}
        return {str(p): (str(t), int(o)) for p, t, o in con.execute("SELECT path, to_path, row_offset FROM moved")}

    def _has_moved(self, con) -> bool:
        return con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'moved'").fetchone() is not None

    def record_moves(self, con, seq: int, moves: list[tuple[str, str, int]]) -> None:
        """Inside the transaction `con` that retires them: rows of shard `path` are now rows from
        `row_offset` on of `to_path`, for each (path, to_path, row_offset) of `moves`."""
        con.execute(MOVED_DDL)
        self._mark_moved(con)
        con.executemany("INSERT INTO moved (path, to_path, row_offset, seq) VALUES (?, ?, ?, ?)",
                        [(p, t, o, seq) for p, t, o in moves])

    def _mark_moved(self, con) -> None:
        """Schema version 2 from the first move on: an older rollstore, which would not follow
        `moved`, refuses the buffer instead of compacting a shard that references reach through it."""
        con.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version' AND value = '1'")

    # ---- the checkpoint index (CHECKPOINT_DDL) --------------------------------------------
    def has_table(self, name: str, con=None) -> bool:
        return (con or self.con).execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None

    def index_checkpoints(self, con, rows: list[tuple]) -> None:
        """Inside the transaction `con`: index rows, each the values of CHECKPOINT_COLS but the last two."""
        for statement in CHECKPOINT_DDL:
            con.execute(statement)
        if rows:
            con.executemany(f"INSERT INTO checkpoint_index ({', '.join(CHECKPOINT_COLS[:8])}) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def record_ledger(self, con, seq: int, rows: list[tuple[int, int, str, list[dict]]]) -> None:
        """Inside the transaction `con`: the consumed ledger of indexed versions, each row (checkpoints
        shard id, version, run, its `consumed` entries). The embedded manifest's; a PostgreSQL
        catalog records its ledger as it publishes (`record_consumed`) and ignores this."""
        con.executemany("INSERT INTO consumed (run_id, shard, curation_id, version, checkpoint_shard_id, seq) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        [(run, e["shard"], e.get("curation_id"), int(v), int(i), int(seq))
                         for i, v, run, entries in rows for e in entries])

    def consumed_by(self, shards: list[str], run_id: str | None = None, con=None,
                    exclude: tuple = ()) -> list[tuple[str, int]]:
        """(shard, version) of the live checkpoints (of `run_id`; but the checkpoints shards `exclude`)
        that consumed any of `shards`: an index lookup per shard, whatever the history."""
        con = con or self.con
        out: list[tuple[str, int]] = []
        if not self.has_table("consumed", con):
            return out  # no checkpoint published yet
        for i in range(0, len(shards), 500):
            chunk = list(shards[i:i + 500])
            sql = ("SELECT c.shard, c.version FROM consumed c JOIN shards s ON s.shard_id = c.checkpoint_shard_id "
                   f"WHERE s.removed_seq IS NULL AND c.shard IN ({', '.join('?' * len(chunk))})")
            if run_id is not None:
                sql += " AND c.run_id = ?"
                chunk.append(run_id)
            if exclude:
                sql += f" AND c.checkpoint_shard_id NOT IN ({', '.join('?' * len(exclude))})"
                chunk += list(exclude)
            out += [(str(sh), int(v)) for sh, v in con.execute(sql + " ORDER BY c.shard, c.version", chunk)]
        return out

    def checkpoint_index(self, seq: int | None = None, run_id: str | None = None, version: int | None = None,
                         newest: bool = False, con=None) -> tuple[list[tuple], list[tuple[int, str]]]:
        """(the index rows (CHECKPOINT_COLS) of the checkpoints visible at snapshot `seq` (latest when
        None; inside `con` when given), of `run_id` / `version` when given, by version (`newest`: the
        highest alone); the (shard_id, path) of visible `checkpoints` shards that have no index row,
        whose rows only their files hold)."""
        con = con or self.con
        visible, args = _visible(seq)
        if not self.has_table("checkpoint_index", con):
            return [], self.unindexed_checkpoints(seq, con)
        sql = (f"SELECT {', '.join('c.' + c for c in CHECKPOINT_COLS)} FROM checkpoint_index c "
               f"JOIN shards s ON s.shard_id = c.shard_id WHERE {visible}")
        where = list(args)
        if run_id is not None:
            sql += " AND c.run_id = ?"
            where.append(run_id)
        if version is not None:
            sql += " AND c.version = ?"
            where.append(int(version))
        sql += " ORDER BY c.version DESC LIMIT 1" if newest else " ORDER BY c.version"
        return con.execute(sql, where).fetchall(), self.unindexed_checkpoints(seq, con)

    def unindexed_checkpoints(self, seq: int | None = None, con=None) -> list[tuple[int, str]]:
        """(shard_id, path) of the `checkpoints` shards visible at `seq` (live when None) that have no
        index row (published before the index existed, or by a rollstore without it)."""
        con = con or self.con
        visible, args = _visible(seq)
        sql = f"SELECT s.shard_id, s.path FROM shards s WHERE s.table_name = 'checkpoints' AND {visible}"
        if self.has_table("checkpoint_index", con):
            sql += " AND NOT EXISTS (SELECT 1 FROM checkpoint_index c WHERE c.shard_id = s.shard_id)"
            through = con.execute("SELECT value FROM meta WHERE key = 'checkpoints_indexed_through'").fetchone()
            if through is not None and seq is None:  # every live one up to it is indexed: look past it only
                sql += " AND s.shard_id > ?"
                args = [*args, int(through[0])]
        return [(int(i), str(p)) for i, p in con.execute(sql + " ORDER BY s.shard_id", args)]

    def indexed_through(self, con, shard_id: int) -> None:
        """Inside the transaction that indexed every live checkpoints shard up to `shard_id`: say so,
        so that looking for unindexed ones reads only the shards committed after it."""
        con.execute("INSERT INTO meta (key, value) VALUES ('checkpoints_indexed_through', ?) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(int(shard_id)),))

    # ---- the step index (STEP_INDEX_DDL) ------------------------------------------------
    def index_steps(self, con, rows: list[tuple]) -> None:
        """Inside the transaction `con` that adds the shards: their step index rows, each (shard_id,
        table_name, run_id, step_min, step_max); then `steps_indexed_through` moves up to the newest
        shard below which every shard of STEP_INDEXED tables has its rows (a shard committed by a
        rollstore without the index, or before it, holds it back until gc deletes its row).
        Portable SQL (SQLite and PostgreSQL catalogs)."""
        for statement in STEP_INDEX_DDL:
            con.execute(statement)
        if rows:
            con.executemany("INSERT INTO shard_steps (shard_id, table_name, run_id, step_min, step_max) "
                            "VALUES (?, ?, ?, ?, ?)", rows)
        through = self._steps_indexed_through(con)
        marks = ", ".join("?" * len(STEP_INDEXED))
        gap = con.execute(
            f"SELECT min(s.shard_id) FROM shards s WHERE s.shard_id > ? AND s.table_name IN ({marks}) "
            "AND NOT EXISTS (SELECT 1 FROM shard_steps x WHERE x.shard_id = s.shard_id)",
            (through, *STEP_INDEXED)).fetchone()[0]
        top = (con.execute("SELECT max(shard_id) FROM shards").fetchone()[0] or 0) if gap is None else int(gap) - 1
        if top > through:
            con.execute("INSERT INTO meta (key, value) VALUES ('steps_indexed_through', ?) "
                        "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(int(top)),))

    def _steps_indexed_through(self, con) -> int:
        row = con.execute("SELECT value FROM meta WHERE key = 'steps_indexed_through'").fetchone()
        return -1 if row is None else int(row[0])

    def step_shard_ids(self, table: str, run_id: str, first: int | None, last: int | None,
                       seq: int | None = None, con=None) -> set[int]:
        """The ids of the shards of `table` (one of STEP_INDEXED) visible at snapshot `seq` (live when
        None) that may hold a row of `run_id` with a step in [`first`, `last`] (None: unbounded): those
        whose index rows say so, and every one without index rows (committed before the index, or by a
        rollstore without it: read by every look-up until gc deletes its row). Index look-ups only
        when every shard is indexed: the cost does not grow with the shards of other steps."""
        con = con or self.con
        visible, args = _visible(seq)
        if not self.has_table("shard_steps", con):
            return {int(r[0]) for r in con.execute(
                f"SELECT s.shard_id FROM shards s WHERE s.table_name = ? AND {visible}", (table, *args))}
        sql = ("SELECT s.shard_id FROM shard_steps x JOIN shards s ON s.shard_id = x.shard_id "
               f"WHERE x.table_name = ? AND x.run_id = ? AND {visible}")
        where: list = [table, run_id, *args]
        if first is not None:
            sql += " AND x.step_max >= ?"
            where.append(int(first))
        if last is not None:
            sql += " AND x.step_min <= ?"
            where.append(int(last))
        found = {int(r[0]) for r in con.execute(sql, where)}
        found.update(int(r[0]) for r in con.execute(
            f"SELECT s.shard_id FROM shards s WHERE s.shard_id > ? AND s.table_name = ? AND {visible} "
            "AND NOT EXISTS (SELECT 1 FROM shard_steps x WHERE x.shard_id = s.shard_id)",
            (self._steps_indexed_through(con), table, *args)))
        return found

    # ---- prompt state (PROMPT_STATE_DDL, storage.prompt_state) ----------------------------
    def record_prompt_state(self, con, seq: int, new_ids: list[int], groups: dict, selections: dict) -> None:
        """Inside the transaction `con` of commit `seq` that adds the shards `new_ids` (their step index
        recorded first, `index_steps`): fold `groups` ({(run, prompt): storage.prompt_state.Groups}) and
        `selections` ({run: Selected}) into the state of their runs. A run met for the first time is kept
        only when no earlier shard holds a row of it; one whose rows come out of order stops being kept
        (`storage.prompt_state` invariants). Portable SQL (SQLite and PostgreSQL catalogs)."""
        from .prompt_state import merged

        for statement in PROMPT_STATE_DDL:
            con.execute(statement)
        runs = sorted({run for run, _ in groups} | set(selections))
        for run in runs:
            row = con.execute("SELECT tracked, sel_step, sel_position, explore_easy, explore_hard FROM "
                              "prompt_state_runs WHERE run_id = ?", (run,)).fetchone()
            if row is None:
                earlier = (self.step_shard_ids("rollouts", run, None, None, con=con)
                           | self.step_shard_ids("prompt_selections", run, None, None, con=con)) - set(new_ids)
                row = (0 if earlier else 1, None, None, None, None)
                con.execute("INSERT INTO prompt_state_runs (run_id, tracked, seq) VALUES (?, ?, ?)",
                            (run, row[0], int(seq)))
            tracked, sel_step, sel_position, easy, hard = row
            mine = {p: g for (r, p), g in groups.items() if r == run}
            states: list[tuple] = []
            if tracked and mine:
                old = {}
                names = sorted(mine)
                for i in range(0, len(names), 500):
                    chunk = names[i:i + 500]
                    old.update({str(r[0]): tuple(r[1:]) for r in con.execute(
                        "SELECT prompt_id, groups, streak, newest_step, newest_group, newest_all_correct "
                        f"FROM prompt_state WHERE run_id = ? AND prompt_id IN ({', '.join('?' * len(chunk))})",
                        (run, *chunk))})
                for p in names:
                    state = None if mine[p] is None else merged(old.get(p), mine[p])
                    if state is None:
                        tracked = 0
                        break
                    states.append((run, p, *state))
            sel = selections.get(run, False)
            if tracked and sel is not False:
                if sel is None or (sel_step is not None and sel.first <= sel_step):
                    tracked = 0
                else:
                    sel_step, easy, hard = sel.last, sel.easy, sel.hard
                    sel_position = sel.position if sel_position is None else max(sel_position, sel.position)
            if tracked and states:
                con.executemany(
                    "INSERT INTO prompt_state (run_id, prompt_id, groups, streak, newest_step, newest_group, "
                    "newest_all_correct) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, prompt_id) DO UPDATE SET "
                    "groups = excluded.groups, streak = excluded.streak, newest_step = excluded.newest_step, "
                    "newest_group = excluded.newest_group, newest_all_correct = excluded.newest_all_correct", states)
            if not tracked:
                con.execute("DELETE FROM prompt_state WHERE run_id = ?", (run,))
            con.execute("UPDATE prompt_state_runs SET tracked = ?, sel_step = ?, sel_position = ?, explore_easy = ?, "
                        "explore_hard = ?, seq = ? WHERE run_id = ?",
                        (int(tracked), sel_step, sel_position, easy, hard, int(seq), run))

    def forget_prompt_state(self, con) -> None:
        """Inside a transaction that retires or restores shards other than by compaction: no run's prompt
        state is kept from here on (readers recompute from the shards). Portable SQL."""
        if self.has_table("prompt_state_runs", con):
            con.execute("UPDATE prompt_state_runs SET tracked = 0")
            con.execute("DELETE FROM prompt_state")

    def prompt_state(self, run_id: str, prompt_ids: list[str] | None = None) -> tuple[tuple, dict] | None:
        """(the run's row: sel_step, sel_position, explore_easy, explore_hard, seq; {prompt_id: (groups,
        streak, newest_step, newest_group, newest_all_correct)} of those of `prompt_ids` with a group)
        when the run's state is kept, else None. Index look-ups only. Portable SQL."""
        if not self.has_table("prompt_state_runs"):
            return None
        row = self.con.execute("SELECT tracked, sel_step, sel_position, explore_easy, explore_hard, seq FROM "
                               "prompt_state_runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None or not row[0]:
            return None
        found: dict = {}
        names = sorted(set(prompt_ids or ()))
        for i in range(0, len(names), 500):
            chunk = names[i:i + 500]
            found.update({str(r[0]): tuple(r[1:]) for r in self.con.execute(
                "SELECT prompt_id, groups, streak, newest_step, newest_group, newest_all_correct FROM prompt_state "
                f"WHERE run_id = ? AND prompt_id IN ({', '.join('?' * len(chunk))})", (run_id, *chunk))})
        again = self.con.execute("SELECT seq FROM prompt_state_runs WHERE run_id = ?", (run_id,)).fetchone()
        if again is None or again[0] != row[5]:  # a commit landed between the reads: not one state
            return None
        return tuple(row[1:]), found

    # ---- uniqueness of rollouts ------------------------------------------------------------
    def existing_ids(self, rollout_ids: list[str], group_ids: list[str]) -> tuple[set[str], set[str]]:
        found_r: set[str] = set()
        found_g: set[str] = set()
        for start in range(0, len(rollout_ids), 500):
            chunk = rollout_ids[start : start + 500]
            q = "SELECT rollout_id FROM rollout_ids WHERE rollout_id IN (%s)" % ",".join("?" * len(chunk))
            found_r.update(r[0] for r in self.con.execute(q, chunk))
        for start in range(0, len(group_ids), 500):
            chunk = group_ids[start : start + 500]
            q = "SELECT group_id FROM group_ids WHERE group_id IN (%s)" % ",".join("?" * len(chunk))
            found_g.update(r[0] for r in self.con.execute(q, chunk))
        return found_r, found_g

    def register_rollouts(self, con: sqlite3.Connection, shard_id: int, pairs: Iterable[tuple[str, str]],
                          groups: Iterable[str]) -> None:
        """Claim the ids: `pairs` of (rollout_id, group_id) and the distinct `groups`, both consumed
        lazily (a big append never holds all its ids as Python objects). On a conflict undo the
        partial claim (so a lookup sees only others' ids) and raise."""
        con.execute("SAVEPOINT register")
        try:
            con.executemany(
                "INSERT INTO rollout_ids (rollout_id, group_id, shard_id) VALUES (?, ?, ?)",
                ((r, g, shard_id) for r, g in pairs),
            )
            con.executemany(
                "INSERT INTO group_ids (group_id, shard_id) VALUES (?, ?)",
                ((g, shard_id) for g in groups),
            )
        except sqlite3.IntegrityError:
            con.execute("ROLLBACK TO register")
            con.execute("RELEASE register")
            raise
        con.execute("RELEASE register")

    # ---- leases ----------------------------------------------------------------------------
    def lease(self, table: str, n: int, consumer: str, group: str = "default", ttl: float = 600.0) -> tuple[str, list[Shard]]:
        """Lease up to n live shards of `table` not acked or leased (unexpired) in `group`."""
        lease_id = uuid.uuid4().hex
        now = time.time()
        with self.transaction() as con:
            seq = self.latest_seq()
            rows = con.execute(
                f"SELECT {', '.join('s.' + c.strip() for c in _SHARD_COLS.split(','))} FROM shards s "
                "LEFT JOIN leases l ON l.shard_id = s.shard_id AND l.consumer_group = ? "
                "WHERE s.table_name = ? AND s.added_seq <= ? AND s.removed_seq IS NULL "
                "AND (l.shard_id IS NULL OR (l.acked_at IS NULL AND l.expires_at < ?)) "
                "ORDER BY s.added_seq, s.shard_id LIMIT ?",
                (group, table, seq, now, n),
            ).fetchall()
            con.executemany(
                "INSERT OR REPLACE INTO leases (consumer_group, shard_id, consumer, lease_id, expires_at, acked_at)"
                " VALUES (?, ?, ?, ?, ?, NULL)",
                [(group, r[0], consumer, lease_id, now + ttl) for r in rows],
            )
        return lease_id, [Shard(*r) for r in rows]

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

    # ---- snapshot pins (keep files of retired shards while a reader needs them) -------------
    def pin(self, seq: int, ttl: float = 3600.0) -> str:
        pin_id = uuid.uuid4().hex
        with self._pin_transaction() as con:
            con.execute("INSERT INTO pins VALUES (?, ?, ?)", (pin_id, seq, time.time() + ttl))
        return pin_id

    def _pin_transaction(self):
        """The transaction of a pin or an unpin: one that does not wait for the disk (module invariants)."""
        return self.transaction(durable=False)

    def unpin(self, pin_id: str) -> None:
        with self._pin_transaction() as con:
            con.execute("DELETE FROM pins WHERE pin_id = ?", (pin_id,))

    def collected_seq(self) -> int:
        """Highest `removed_seq` of a retired shard that gc deleted: older snapshots are incomplete."""
        row = self.con.execute("SELECT value FROM meta WHERE key = 'collected_seq'").fetchone()
        return 0 if row is None else int(row[0])

    def oldest_pinned_seq(self) -> int | None:
        row = self.con.execute("SELECT min(seq) FROM pins WHERE expires_at > ?", (time.time(),)).fetchone()
        return None if row[0] is None else int(row[0])

    # ---- pins of readers of shards only (a DuckDB session), which keep no checkpoint's files ----
    def pin_shards(self, seq: int, ttl: float = 3600.0) -> str:
        """A pin of `seq` (as `pin`) that keeps the files of the shards visible at it, not the folders of
        checkpoint versions pruned after it (`oldest_checkpoint_pin` leaves it out): what a reader that
        never loads a model's weights holds (a DuckDB session kept between a loop's steps). Its id
        starts with SHARDS_PIN. Portable SQL (SQLite and PostgreSQL catalogs)."""
        pin_id = self.pin(seq, ttl)
        with self._pin_transaction() as con:  # until this commits it is a full pin: stricter, never looser
            con.execute("UPDATE pins SET pin_id = ? WHERE pin_id = ?", (SHARDS_PIN + pin_id, pin_id))
        return SHARDS_PIN + pin_id

    def oldest_checkpoint_pin(self) -> int | None:
        """The oldest snapshot pinned by a reader that may load a checkpoint's files: `oldest_pinned_seq`
        but the pins of `pin_shards`. Portable SQL; the time is the catalog's clock (`catalog_now`)."""
        row = self.con.execute("SELECT min(seq) FROM pins WHERE expires_at > ? AND pin_id NOT LIKE ?",
                               (self.catalog_now(), SHARDS_PIN + "%")).fetchone()
        return None if row[0] is None else int(row[0])

    def catalog_now(self) -> float:
        """The clock pins' expiry is written on: this machine's (a PostgreSQL catalog: the database's)."""
        return time.time()
