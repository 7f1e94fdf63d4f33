"""The SQLite manifest: the single commit point of a buffer.

Invariants:
- Every change is one transaction (`BEGIN IMMEDIATE`) that inserts one `commits` row; its `seq` is
  the snapshot number. A shard is visible at snapshot S iff `added_seq <= S` and
  (`removed_seq` is null or `removed_seq > S`).
- `rollout_ids` and `group_ids` hold every rollout and group of the live `rollouts` shards; their
  primary keys make uniqueness across the buffer hold even between concurrent appenders.
- A lease is held by one consumer at a time per consumer group; an acked shard is never leased again
  in that group; an expired unacked lease returns the shard to the pool.
- WAL mode with synchronous=FULL: a committed transaction survives kill -9 and power loss.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from .errors import ManifestError

MANIFEST = "manifest.sqlite"

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


_SHARD_COLS = "shard_id, table_name, path, rows, tokens, bytes, sha256, key, added_seq, removed_seq"


class Manifest:
    """A connection to one buffer's manifest. One per thread; cheap to open."""

    def __init__(self, root: str, create: bool = False):
        path = os.path.join(root, MANIFEST)
        if not create and not os.path.exists(path):
            raise ManifestError(f"{root}: not a rollstore buffer (no {MANIFEST}); run `rollstore init {root}`")
        self.root = root
        self.con = sqlite3.connect(path, timeout=60.0, isolation_level=None, check_same_thread=False)
        self.con.execute("PRAGMA journal_mode=WAL")
        self.con.execute("PRAGMA synchronous=FULL")
        self.con.execute("PRAGMA busy_timeout=60000")
        if create:
            with self.transaction():
                for statement in filter(str.strip, _DDL.split(";")):
                    self.con.execute(statement)
                self.con.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', '1')")

    def close(self) -> None:
        self.con.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self.con.execute("BEGIN IMMEDIATE")
        try:
            yield self.con
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        else:
            self.con.execute("COMMIT")

    # ---- commits and snapshots -------------------------------------------------------------
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
        return ids

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

    def register_rollouts(self, con: sqlite3.Connection, shard_id: int, rids: list[str], gids: list[str]) -> None:
        """Claim the ids; on a conflict undo the partial claim (so a lookup sees only others' ids) and raise."""
        con.execute("SAVEPOINT register")
        try:
            con.executemany(
                "INSERT INTO rollout_ids (rollout_id, group_id, shard_id) VALUES (?, ?, ?)",
                zip(rids, gids, [shard_id] * len(rids)),
            )
            con.executemany(
                "INSERT INTO group_ids (group_id, shard_id) VALUES (?, ?)",
                [(g, shard_id) for g in dict.fromkeys(gids)],
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
        with self.transaction() as con:
            con.execute("INSERT INTO pins VALUES (?, ?, ?)", (pin_id, seq, time.time() + ttl))
        return pin_id

    def unpin(self, pin_id: str) -> None:
        with self.transaction() as con:
            con.execute("DELETE FROM pins WHERE pin_id = ?", (pin_id,))

    def collected_seq(self) -> int:
        """Highest `removed_seq` of a retired shard that gc deleted: older snapshots are incomplete."""
        row = self.con.execute("SELECT value FROM meta WHERE key = 'collected_seq'").fetchone()
        return 0 if row is None else int(row[0])

    def oldest_pinned_seq(self) -> int | None:
        row = self.con.execute("SELECT min(seq) FROM pins WHERE expires_at > ?", (time.time(),)).fetchone()
        return None if row[0] is None else int(row[0])
