"""The catalog's SQL, written once for both databases (`SqlCatalog`), over a `dialect.Dialect`.

`manifest.Manifest` (SQLite) and `catalog_pg.PgManifest` (PostgreSQL) are siblings under this
class: each brings its connection (`self.con`: `execute(sql, params)` / `executemany` with `?`
parameters, which it puts into its driver's style with `dialect.prepare`, and whose driver errors it
translates into `errors.CatalogError` kinds), its transaction, and the few operations whose SQL
truly differs (a new commit's seq, shard rows, id claims, acks, the consumed ledger's check).

Invariants:
- A shard is visible at snapshot S iff `added_seq <= S` and (`removed_seq` is null or
  `removed_seq > S`); later commits only add rows or set `removed_seq` to a larger seq.
- Tables made on first use (`finite`, `moved`, the checkpoint index, `verified`) are created inside
  the transaction that first writes them; a read of one that does not exist answers "nothing".
- `collected_seq` only rises (the highest `removed_seq` whose files gc deleted).
"""

from __future__ import annotations

import time
import uuid
from typing import Iterable

from .catalog import Catalog, Shard
from .dialect import Dialect
from .errors import CatalogReadOnly

REQUIRED_TABLES = ("meta", "commits", "shards", "rollout_ids", "group_ids", "leases", "pins")
SHARD_COLS = "shard_id, table_name, path, rows, tokens, bytes, sha256, key, added_seq, removed_seq"

# Where the rows of retired rollouts shards went (module invariants of manifest.py); made on first use.
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
    "CREATE INDEX IF NOT EXISTS checkpoint_index_kept ON checkpoint_index (run_id, pruned_seq)",
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
# The shards a verify found good by hash (`verify --incremental`); made on first use.
VERIFIED_DDL = "CREATE TABLE IF NOT EXISTS verified (shard_id BIGINT PRIMARY KEY, verified_at DOUBLE PRECISION NOT NULL)"

SHARDS_PIN = "shards-"  # the id prefix of a pin that keeps shards' files only (`SqlCatalog.pin_shards`)
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
    # the newest `created_at` of each rollouts shard (µs; null: no row): the default batch's latest step
    # is looked for in the shards holding the newest rows only (`newest_shard_ids`)
    "CREATE TABLE IF NOT EXISTS shard_times (shard_id BIGINT PRIMARY KEY, created_max BIGINT)",
    "CREATE INDEX IF NOT EXISTS shard_times_by_time ON shard_times (created_max)",
)
# The keys (curation ids) of a shard that compaction merged from shards of several keys (audit shards):
# the merged shard's own `key` is null, its rows name their curation; made by the first such merge.
SHARD_KEYS_DDL = (
    "CREATE TABLE IF NOT EXISTS shard_keys (shard_id BIGINT NOT NULL, key TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS shard_keys_by_shard ON shard_keys (shard_id)",
)
# Each shard's Arrow schema as it was written (its fields; the Parquet footer's key-value metadata left
# out), recorded in the commit that adds it (`Buffer.commit`): a reader that binds a table's every file
# (a report, a session's view of a whole table) learns whether their schemas differ, and which columns
# each holds, without opening thousands of footers (`storage.snapshot.declare_schemas`). Shards
# committed before it have no row: their footers are read, as before. Made by the first commit that
# records one; CREATE TABLE only (no CREATE INDEX inside a commit: on PostgreSQL it locks the table).
# `schemas` has no unique key, on purpose: every writer records the same few bodies, and on PostgreSQL
# an insert that meets a unique key another open transaction just wrote waits for that transaction
# (a stalled writer would stall every other); two writers may each add a body the other added (the
# same text under the same id), which readers take once.
SCHEMA_DDL = (
    "CREATE TABLE IF NOT EXISTS shard_schemas (shard_id BIGINT PRIMARY KEY, schema_id TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS schemas (schema_id TEXT NOT NULL, body TEXT NOT NULL)",
)
# Indexes of `shards` an older embedded manifest lacks (`table_stamp`'s look-up of a table's newest
# retirement; `live_keyed`'s of one curation's shards), made with the step index on SQLite only: there a
# commit holds the whole file anyway, while on PostgreSQL `CREATE INDEX` would hold a lock on `shards`
# until its commit ends, beside every other host's writers (a PostgreSQL catalog has them from its creation).
SQLITE_SHARDS_DDL = (
    "CREATE INDEX IF NOT EXISTS shards_by_removal ON shards (table_name, removed_seq)",
    "CREATE INDEX IF NOT EXISTS shards_by_key ON shards (table_name, key)",
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


def visible(seq: int | None) -> tuple[str, list]:
    """The condition (on shards `s`) and arguments of "visible at snapshot `seq`" (None: live now)."""
    if seq is None:
        return "s.removed_seq IS NULL", []
    return "s.added_seq <= ? AND (s.removed_seq IS NULL OR s.removed_seq > ?)", [seq, seq]


class SqlCatalog(Catalog):
    """The operations both catalogs share, each one SQL text with dialect hooks."""

    dialect: Dialect
    con = None  # the sibling's connection

    def require_writable(self) -> None:
        """Raise `CatalogReadOnly` (one line) when this catalog could only be opened read-only."""
        if self.read_only is not None:
            raise CatalogReadOnly(f"{self.path}: cannot be written ({self.read_only}; opened read-only); "
                                  "nothing was written")

    def _pin_transaction(self):
        """The transaction of a pin, an unpin and other records whose loss costs only a repeat."""
        return self.transaction()

    # ---- commits and shards -----------------------------------------------------------------
    def latest_seq(self) -> int:
        return int(self.con.execute("SELECT coalesce(max(seq), 0) FROM commits").fetchone()[0])

    def shards(self, table: str | None = None, seq: int | None = None, after: int | None = None) -> list[Shard]:
        """Shards visible at snapshot `seq` (latest when None), in commit order; with `after`, only
        those added after commit `after` (a range of the index on (table_name, added_seq))."""
        seq = self.latest_seq() if seq is None else seq
        sql = f"SELECT {SHARD_COLS} FROM shards WHERE added_seq <= ? AND (removed_seq IS NULL OR removed_seq > ?)"
        args: list = [seq, seq]
        if table is not None:
            sql += " AND table_name = ?"
            args.append(table)
        if after is not None:
            sql += " AND added_seq > ?"
            args.append(int(after))
        return [Shard(*row) for row in self.con.execute(sql + " ORDER BY added_seq, shard_id", args)]

    def table_stamp(self, table: str, seq: int) -> tuple:
        """(newest add, newest retirement at or before `seq`, collected_seq): equal for two snapshots
        only when no shard of `table` was added or retired between them. gc deletes only rows retired
        at or before `collected_seq`, so while it is unchanged no retirement between the two can have
        lost its row. Two index look-ups (`shards_by_table`, `shards_by_removal`)."""
        row = self.con.execute(
            "SELECT (SELECT max(added_seq) FROM shards WHERE table_name = ? AND added_seq <= ?), "
            "(SELECT max(removed_seq) FROM shards WHERE table_name = ? AND removed_seq <= ?)",
            (table, seq, table, seq)).fetchone()
        return row[0], row[1], self.collected_seq()

    def merge_targets(self, paths: list[str]) -> set[str]:
        if not paths or not self.has_table("moved"):
            return set()
        found: set[str] = set()
        for cond, args in self.dialect.in_list("to_path", list(paths)):
            found.update(str(r[0]) for r in self.con.execute(f"SELECT DISTINCT to_path FROM moved WHERE {cond}", args))
        return found

    def shards_by_id(self, ids: list[int], con=None) -> list[Shard]:
        rows = {}
        for cond, args in self.dialect.in_list("shard_id", [int(i) for i in ids], "bigint"):
            rows.update((r[0], Shard(*r)) for r in (con or self.con).execute(f"SELECT {SHARD_COLS} FROM shards WHERE {cond}", args))
        return [rows[i] for i in ids]

    def live_key_count(self, table: str, key: str, con=None) -> int:
        """Live shards of `table` under `key` (e.g. a curation's record), read inside `con` when given."""
        return int((con or self.con).execute(
            "SELECT count(*) FROM shards WHERE table_name = ? AND key = ? AND removed_seq IS NULL", (table, key),
        ).fetchone()[0])

    def live_keyed(self, table: str, keys: list[str]) -> list[Shard]:
        """The live shards of `table` under any of `keys` (or under none: older shards), in shard order."""
        sql = f"SELECT {SHARD_COLS} FROM shards WHERE table_name = ? AND removed_seq IS NULL AND "
        out = [Shard(*r) for r in self.con.execute(sql + "key IS NULL ORDER BY shard_id", (table,))]
        for cond, args in self.dialect.in_list("key", keys):
            out += [Shard(*r) for r in self.con.execute(sql + cond, [table, *args])]
        return sorted({s.shard_id: s for s in out}.values(), key=lambda s: s.shard_id)

    def live_paths(self, table: str, con=None) -> list[tuple[int, str]]:
        """(shard_id, path) of the live shards of `table`, in shard order, read inside `con` when given."""
        return [(int(i), str(p)) for i, p in (con or self.con).execute(
            "SELECT shard_id, path FROM shards WHERE table_name = ? AND removed_seq IS NULL ORDER BY shard_id",
            (table,))]

    def all_paths(self) -> set[str]:
        return {row[0] for row in self.con.execute("SELECT path FROM shards")}

    def is_unnamed(self, path: str) -> bool:
        """True when no shard row (live or retired) names `path`: a file there is an orphan."""
        return self.con.execute("SELECT 1 FROM shards WHERE path = ? LIMIT 1", (path,)).fetchone() is None

    def retire_shards(self, con, seq: int, ids: list[int], release_ids: bool = True) -> int:
        done = 0
        for cond, args in self.dialect.in_list("shard_id", [int(i) for i in ids], "bigint"):
            done += con.execute(f"UPDATE shards SET removed_seq = ? WHERE removed_seq IS NULL AND {cond}",
                                [seq, *args]).rowcount
            if release_ids:
                con.execute(f"DELETE FROM rollout_ids WHERE {cond}", args)
                con.execute(f"DELETE FROM group_ids WHERE {cond}", args)
        return done

    def unretire(self, con, shard_id: int, seq: int) -> None:
        con.execute("UPDATE shards SET removed_seq = NULL WHERE shard_id = ? AND removed_seq = ?", (shard_id, seq))

    def retired_paths(self, con, paths: list[str]) -> list[str]:
        live = {r[0] for r in con.execute(
            "SELECT path FROM shards WHERE table_name = 'rollouts' AND removed_seq IS NULL")}
        gone = [p for p in paths if p not in live]
        if gone:
            moved = self.moves(con)
            gone = [p for p in gone if p not in moved]
        return gone

    def committed_since(self, con, table: str, seq: int, key: str) -> list[tuple[str, str]]:
        return [(str(p), str(k)) for p, k in con.execute(
            "SELECT s.path, s.key FROM shards s WHERE s.table_name = ? AND s.removed_seq IS NULL "
            f"AND s.added_seq > ? AND s.key {self.dialect.distinct} ? AND EXISTS (SELECT 1 FROM shards c WHERE "
            "c.table_name = 'curations' AND c.key = s.key AND c.removed_seq IS NULL) ORDER BY s.shard_id",
            (table, seq, key)).fetchall()]

    # ---- ids, moves ---------------------------------------------------------------------------
    def existing_ids(self, rollout_ids: list[str], group_ids: list[str]) -> tuple[set[str], set[str]]:
        found_r: set[str] = set()
        found_g: set[str] = set()
        for cond, args in self.dialect.in_list("rollout_id", rollout_ids):
            found_r.update(r[0] for r in self.con.execute(f"SELECT rollout_id FROM rollout_ids WHERE {cond}", args))
        for cond, args in self.dialect.in_list("group_id", group_ids):
            found_g.update(r[0] for r in self.con.execute(f"SELECT group_id FROM group_ids WHERE {cond}", args))
        return found_r, found_g

    def rollout_shards(self, rollout_ids: list[str]) -> dict[str, int]:
        """{rollout_id: the id of the live rollouts shard that holds it} of those of `rollout_ids` that a
        live shard holds (`rollout_ids`, kept as compaction moves rows)."""
        found: dict[str, int] = {}
        for cond, args in self.dialect.in_list("rollout_id", rollout_ids):
            found.update((str(r), int(i)) for r, i in self.con.execute(
                f"SELECT rollout_id, shard_id FROM rollout_ids WHERE {cond}", args))
        return found

    def move_ids(self, con, shard_ids: list[int], to: int) -> None:
        for cond, args in self.dialect.in_list("shard_id", [int(i) for i in shard_ids], "bigint"):
            con.execute(f"UPDATE rollout_ids SET shard_id = ? WHERE {cond}", [int(to), *args])
            con.execute(f"UPDATE group_ids SET shard_id = ? WHERE {cond}", [int(to), *args])

    def moves(self, con=None) -> dict[str, tuple[str, int]]:
        """{retired rollouts shard path: (the path its rows were moved to, their first row there)};
        empty for a catalog no compaction has moved rows in. Read inside `con` when given."""
        con = con or self.con
        if not self.has_table("moved", con):
            return {}
        return {str(p): (str(t), int(o)) for p, t, o in con.execute("SELECT path, to_path, row_offset FROM moved")}

    def record_moves(self, con, seq: int, moves: list[tuple[str, str, int]]) -> None:
        """Inside the transaction `con` that retires them: rows of shard `path` are now rows from
        `row_offset` on of `to_path`, for each (path, to_path, row_offset) of `moves`. The first move
        makes an embedded manifest schema version 2 (an older rollstore then refuses it)."""
        con.execute(MOVED_DDL)
        con.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version' AND value = '1'")
        con.executemany("INSERT INTO moved (path, to_path, row_offset, seq) VALUES (?, ?, ?, ?)",
                        [(p, t, o, seq) for p, t, o in moves])

    def has_table(self, name: str, con=None) -> bool:
        return bool((con or self.con).execute(self.dialect.has_table(), (name,)).fetchone()[0])

    # ---- leases and pins (on the dialect's clock) ----------------------------------------------
    def lease(self, table: str, n: int, consumer: str, group: str = "default", ttl: float = 600.0) -> tuple[str, list[Shard]]:
        """Lease up to n live shards of `table` not acked or leased (unexpired) in `group`."""
        lease_id = uuid.uuid4().hex
        cols = ", ".join("s." + c.strip() for c in SHARD_COLS.split(","))
        with self.transaction() as con:
            clock, args = self.dialect.now()
            now = float(con.execute(f"SELECT {clock}", args).fetchone()[0])
            seq = self.latest_seq()
            rows = con.execute(
                f"SELECT {cols} FROM shards s "
                "LEFT JOIN leases l ON l.shard_id = s.shard_id AND l.consumer_group = ? "
                "WHERE s.table_name = ? AND s.added_seq <= ? AND s.removed_seq IS NULL "
                "AND (l.shard_id IS NULL OR (l.acked_at IS NULL AND l.expires_at < ?)) "
                "ORDER BY s.added_seq, s.shard_id LIMIT ?",
                (group, table, seq, now, n),
            ).fetchall()
            con.executemany(
                self.dialect.upsert("leases", ("consumer_group", "shard_id", "consumer", "lease_id", "expires_at",
                                               "acked_at"), ("consumer_group", "shard_id")),
                [(group, r[0], consumer, lease_id, now + ttl, None) for r in rows],
            )
        return lease_id, [Shard(*r) for r in rows]

    def leased_ids(self, con=None) -> set[int]:
        return {int(r[0]) for r in (con or self.con).execute("SELECT DISTINCT shard_id FROM leases")}

    def pin(self, seq: int, ttl: float = 3600.0) -> str:
        pin_id = uuid.uuid4().hex
        clock, args = self.dialect.now()
        with self._pin_transaction() as con:
            con.execute(f"INSERT INTO pins VALUES (?, ?, {clock} + ?)", (pin_id, seq, *args, float(ttl)))
        return pin_id

    def unpin(self, pin_id: str) -> None:
        with self._pin_transaction() as con:
            con.execute("DELETE FROM pins WHERE pin_id = ?", (pin_id,))

    def oldest_pinned_seq(self) -> int | None:
        clock, args = self.dialect.now()
        row = self.con.execute(f"SELECT min(seq) FROM pins WHERE expires_at > {clock}", args).fetchone()
        return None if row[0] is None else int(row[0])

    # ---- gc and verify ------------------------------------------------------------------------
    def collected_seq(self) -> int:
        """Highest `removed_seq` of a retired shard that gc deleted: older snapshots are incomplete."""
        row = self.con.execute("SELECT value FROM meta WHERE key = 'collected_seq'").fetchone()
        return 0 if row is None else int(row[0])

    def retired_rows(self) -> list[tuple[int, str, int]]:
        return [(int(i), str(p), int(r)) for i, p, r in self.con.execute(
            "SELECT shard_id, path, removed_seq FROM shards WHERE removed_seq IS NOT NULL").fetchall()]

    def forget_retired(self, con, ids: list[int], removed_seq: int) -> None:
        keyed = self.has_table("shard_keys", con)  # (shard_steps' and shard_times' rows stay: joined to shards,
        # they name nothing once their shard is gone, and gc takes no lock every append's DDL takes)
        for cond, args in self.dialect.in_list("shard_id", [int(i) for i in ids], "bigint"):
            con.execute(f"DELETE FROM shards WHERE {cond}", args)
            if keyed:
                con.execute(f"DELETE FROM shard_keys WHERE {cond}", args)

        d = self.dialect
        con.execute("INSERT INTO meta (key, value) VALUES ('collected_seq', ?) ON CONFLICT (key) DO UPDATE "
                    f"SET value = CAST({d.greatest}(CAST(meta.value AS {d.integer}), "
                    f"CAST(excluded.value AS {d.integer})) AS TEXT)", (str(int(removed_seq)),))

    def record_shard_keys(self, con, rows: list[tuple[int, str]]) -> None:
        """Inside the transaction `con` that adds merged shards: (shard_id, key) of each key they hold."""
        for statement in SHARD_KEYS_DDL:
            con.execute(statement)
        con.executemany("INSERT INTO shard_keys (shard_id, key) VALUES (?, ?)", rows)

    def record_schemas(self, con, rows: list[tuple[int, str]], bodies: dict[str, str]) -> None:
        """Inside the transaction `con` that adds the shards: (shard_id, schema_id) of each, and the
        body (hex of the serialised Arrow schema) of each schema_id (`SCHEMA_DDL`)."""
        for statement in SCHEMA_DDL:
            con.execute(statement)
        known = set()
        for cond, args in self.dialect.in_list("schema_id", sorted(bodies)):
            known.update(str(r[0]) for r in con.execute(f"SELECT schema_id FROM schemas WHERE {cond}", args))
        con.executemany("INSERT INTO schemas (schema_id, body) VALUES (?, ?)",
                        [(k, b) for k, b in sorted(bodies.items()) if k not in known])
        con.executemany("INSERT INTO shard_schemas (shard_id, schema_id) VALUES (?, ?)", rows)

    def shard_schemas(self, ids: list[int]) -> dict[int, str]:
        """{shard_id: the hex of its serialised Arrow schema} of those of `ids` whose schema was recorded."""
        if not ids or not self.has_table("shard_schemas"):
            return {}
        found: dict[int, str] = {}
        for cond, args in self.dialect.in_list("shard_id", [int(i) for i in ids], "bigint"):
            found.update((int(i), str(k)) for i, k in self.con.execute(
                f"SELECT shard_id, schema_id FROM shard_schemas WHERE {cond}", args))
        bodies: dict[str, str] = {}
        for cond, args in self.dialect.in_list("schema_id", sorted(set(found.values()))):
            bodies.update((str(k), str(b)) for k, b in self.con.execute(
                f"SELECT schema_id, body FROM schemas WHERE {cond}", args))
        return {i: bodies[k] for i, k in found.items() if k in bodies}

    def shard_keys(self, ids: list[int]) -> dict[int, list[str]]:
        """{shard_id: the keys it holds} of those of `ids` that compaction merged from several keys."""
        out: dict[int, list[str]] = {}
        if not ids or not self.has_table("shard_keys"):
            return out
        for cond, args in self.dialect.in_list("shard_id", [int(i) for i in ids], "bigint"):
            for i, k in self.con.execute(f"SELECT shard_id, key FROM shard_keys WHERE {cond} ORDER BY key", args):
                out.setdefault(int(i), []).append(str(k))
        return out

    def verified_ids(self) -> set[int]:
        if not self.has_table("verified"):
            return set()
        return {int(r[0]) for r in self.con.execute("SELECT shard_id FROM verified")}

    def record_verified(self, shard_ids: list[int]) -> None:
        known = self.verified_ids()
        new = [(int(i), time.time()) for i in shard_ids if int(i) not in known]
        with self._pin_transaction() as con:
            con.execute(VERIFIED_DDL)
            con.executemany("INSERT INTO verified (shard_id, verified_at) VALUES (?, ?)", new)

    def quarantined(self) -> list[tuple[int, int]]:
        return [(int(i), int(s)) for i, s in self.con.execute(
            "SELECT s.shard_id, s.removed_seq FROM shards s JOIN commits c ON c.seq = s.removed_seq "
            "WHERE c.kind = 'quarantine' ORDER BY s.shard_id").fetchall()]

    def data_marker(self) -> str | None:
        row = self.con.execute("SELECT value FROM meta WHERE key = 'data_marker'").fetchone()
        return None if row is None else row[0]

    # ---- the checkpoint index and ledger --------------------------------------------------------
    def index_checkpoints(self, con, rows: list[tuple]) -> None:
        """Inside the transaction `con`: index rows, each the values of CHECKPOINT_COLS but the last two."""
        for statement in CHECKPOINT_DDL:
            con.execute(statement)
        if rows:
            con.executemany(f"INSERT INTO checkpoint_index ({', '.join(CHECKPOINT_COLS[:8])}) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def consumed_by(self, shards: list[str], run_id: str | None = None, con=None,
                    exclude: tuple = ()) -> list[tuple[str, int]]:
        """(shard, version) of the live checkpoints (of `run_id`; but the checkpoints shards `exclude`)
        that consumed any of `shards`: an index lookup per shard, whatever the history."""
        con = con or self.con
        out: list[tuple[str, int]] = []
        if not self.has_table("consumed", con):
            return out  # no checkpoint published yet
        for cond, args in self.dialect.in_list("c.shard", list(shards)):
            sql = ("SELECT c.shard, c.version FROM consumed c JOIN shards s ON s.shard_id = c.checkpoint_shard_id "
                   f"WHERE s.removed_seq IS NULL AND {cond}")
            if run_id is not None:
                sql += " AND c.run_id = ?"
                args = [*args, run_id]
            if exclude:
                sql += f" AND c.checkpoint_shard_id NOT IN ({', '.join('?' * len(exclude))})"
                args = [*args, *exclude]
            out += [(str(sh), int(v)) for sh, v in con.execute(sql + " ORDER BY c.shard, c.version", args)]
        return out

    def checkpoint_index(self, seq: int | None = None, run_id: str | None = None, version: int | None = None,
                         newest: int = 0, con=None, unpruned: bool = False
                         ) -> tuple[list[tuple], list[tuple[int, str]]]:
        """(the index rows (CHECKPOINT_COLS) of the checkpoints visible at snapshot `seq` (latest when
        None; inside `con` when given), of `run_id` / `version` when given, by version (`newest` > 0:
        the highest `newest` alone, highest first; `unpruned`: those whose files retention kept); the
        (shard_id, path) of visible `checkpoints` shards that have no index row, whose rows only their
        files hold)."""
        con = con or self.con
        cond, args = visible(seq)
        if not self.has_table("checkpoint_index", con):
            return [], self.unindexed_checkpoints(seq, con)
        sql = (f"SELECT {', '.join('c.' + c for c in CHECKPOINT_COLS)} FROM checkpoint_index c "
               f"JOIN shards s ON s.shard_id = c.shard_id WHERE {cond}")
        where = list(args)
        if run_id is not None:
            sql += " AND c.run_id = ?"
            where.append(run_id)
        if version is not None:
            sql += " AND c.version = ?"
            where.append(int(version))
        if unpruned:
            sql += " AND c.pruned_seq IS NULL"
        if newest:
            sql += " ORDER BY c.version DESC LIMIT ?"
            where.append(int(newest))
        else:
            sql += " ORDER BY c.version"
        return con.execute(sql, where).fetchall(), self.unindexed_checkpoints(seq, con)

    def unindexed_checkpoints(self, seq: int | None = None, con=None) -> list[tuple[int, str]]:
        """(shard_id, path) of the `checkpoints` shards visible at `seq` (live when None) that have no
        index row (published before the index existed, or by a rollstore without it)."""
        con = con or self.con
        cond, args = visible(seq)
        sql = f"SELECT s.shard_id, s.path FROM shards s WHERE s.table_name = 'checkpoints' AND {cond}"
        if not self.has_table("checkpoint_index", con):
            return [(int(i), str(p)) for i, p in con.execute(sql + " ORDER BY s.shard_id", args)]
        sql += " AND NOT EXISTS (SELECT 1 FROM checkpoint_index c WHERE c.shard_id = s.shard_id)"
        through = con.execute("SELECT value FROM meta WHERE key = 'checkpoints_indexed_through'").fetchone()
        if through is None:
            return [(int(i), str(p)) for i, p in con.execute(sql + " ORDER BY s.shard_id", args)]
        # Every shard up to `through` that was live when it was set is indexed: an unindexed one up to it
        # was retired before, so a snapshot sees it only if it is retired after the snapshot (an index
        # range of `shards_by_removal`); past `through`, a range of shard ids. No look-up reads them all.
        found = con.execute(sql + " AND s.shard_id > ?", [*args, int(through[0])]).fetchall()
        if seq is not None:
            found += con.execute(sql + " AND s.shard_id <= ? AND s.removed_seq > ?",
                                 [*args, int(through[0]), int(seq)]).fetchall()
        return sorted((int(i), str(p)) for i, p in found)

    def indexed_through(self, con, shard_id: int | None = None) -> None:
        """Inside the transaction that indexed every live checkpoints shard up to `shard_id` (None: every
        shard committed so far): say so, so that looking for unindexed ones reads only later shards."""
        if shard_id is None:
            shard_id = int(con.execute("SELECT coalesce(max(shard_id), 0) FROM shards").fetchone()[0])
        con.execute(self.dialect.upsert("meta", ("key", "value"), ("key",)),
                    ("checkpoints_indexed_through", str(int(shard_id))))

    def hold_checkpoint(self, holder: str, version: int, ttl: float) -> None:
        clock, args = self.dialect.now()
        with self.transaction() as con:
            self.index_checkpoints(con, [])  # the tables, on first use
            con.execute("DELETE FROM checkpoint_holds WHERE holder = ?", (holder,))
            con.execute(f"INSERT INTO checkpoint_holds (holder, version, expires_at) VALUES (?, ?, {clock} + ?)",
                        (holder, int(version), *args, float(ttl)))

    def release_checkpoint(self, holder: str) -> None:
        if self.has_table("checkpoint_holds"):
            with self.transaction() as con:
                con.execute("DELETE FROM checkpoint_holds WHERE holder = ?", (holder,))

    def tag_checkpoint(self, version: int, name: str | None) -> None:
        with self.transaction() as con:
            self.index_checkpoints(con, [])
            con.execute("UPDATE checkpoint_index SET tag = ? WHERE version = ?", (name, int(version)))

    def checkpoint_holds(self, con) -> dict[int, str]:
        if not self.has_table("checkpoint_holds", con):
            return {}
        clock, args = self.dialect.now()
        return {int(v): str(h) for h, v in con.execute(
            f"SELECT holder, version FROM checkpoint_holds WHERE expires_at > {clock} ORDER BY holder", args)}

    def prune_checkpoints(self, con, seq: int, shard_ids: list[int]) -> None:
        for cond, args in self.dialect.in_list("shard_id", [int(i) for i in shard_ids], "bigint"):
            con.execute(f"UPDATE checkpoint_index SET pruned_seq = ? WHERE pruned_seq IS NULL AND {cond}", [seq, *args])

    def pruned_uncollected(self) -> list[tuple[int, str, int]]:
        if not self.has_table("checkpoint_index"):
            return []
        return [(int(i), str(p), int(s)) for i, p, s in self.con.execute(
            "SELECT shard_id, path, pruned_seq FROM checkpoint_index "
            "WHERE pruned_seq IS NOT NULL AND collected IS NULL").fetchall()]

    def mark_collected(self, shard_ids: list[int]) -> None:
        with self._pin_transaction() as con:  # the files are gone whatever this records
            con.executemany("UPDATE checkpoint_index SET collected = 1 WHERE shard_id = ?", [(int(i),) for i in shard_ids])

    # ---- the step index (STEP_INDEX_DDL) ------------------------------------------------
    def index_steps(self, con, rows: list[tuple], times: list[tuple] = ()) -> None:
        """Inside the transaction `con` that adds the shards: their step index rows, each (shard_id,
        table_name, run_id, step_min, step_max), and each rollouts shard's (shard_id, newest created_at
        in µs); then `steps_indexed_through` moves up to the newest shard below which every shard of
        STEP_INDEXED tables has its rows (a shard committed by a rollstore without the index, or before
        it, holds it back until gc deletes its row), and `times_indexed_through` likewise for the
        rollouts shards' times. Portable SQL (SQLite and PostgreSQL catalogs)."""
        for statement in STEP_INDEX_DDL + (SQLITE_SHARDS_DDL if self.dialect.name == "sqlite" else ()):
            con.execute(statement)
        if rows:
            con.executemany("INSERT INTO shard_steps (shard_id, table_name, run_id, step_min, step_max) "
                            "VALUES (?, ?, ?, ?, ?)", rows)
        if times:
            con.executemany("INSERT INTO shard_times (shard_id, created_max) VALUES (?, ?)", list(times))
        self._move_marker(con, "times_indexed_through", "shard_times", ("rollouts",))
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

    def _move_marker(self, con, key: str, index: str, tables: tuple[str, ...]) -> None:
        """Move meta `key` up to the newest shard below which every shard of `tables` has a row in `index`."""
        row = con.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        through = -1 if row is None else int(row[0])
        marks = ", ".join("?" * len(tables))
        gap = con.execute(
            f"SELECT min(s.shard_id) FROM shards s WHERE s.shard_id > ? AND s.table_name IN ({marks}) "
            f"AND NOT EXISTS (SELECT 1 FROM {index} x WHERE x.shard_id = s.shard_id)", (through, *tables)).fetchone()[0]
        top = (con.execute("SELECT max(shard_id) FROM shards").fetchone()[0] or 0) if gap is None else int(gap) - 1
        if top > through:
            con.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE "
                        "SET value = excluded.value", (key, str(int(top))))

    def newest_shard_ids(self, table: str, seq: int) -> set[int] | None:
        """The ids of the shards of `table` (rollouts) visible at `seq` that may hold its newest row by
        `created_at`: those whose newest time is the highest (ties: all of them), and every one without
        a time (committed before the index); None when the catalog has no time index. Index look-ups."""
        if table != "rollouts" or not self.has_table("shard_times"):
            return None
        where_visible, args = visible(seq)
        join = f"FROM shard_times t JOIN shards s ON s.shard_id = t.shard_id WHERE {where_visible}"
        top = self.con.execute(f"SELECT t.created_max {join} AND t.created_max IS NOT NULL "
                               "ORDER BY t.created_max DESC LIMIT 1", args).fetchone()
        found = set() if top is None else {int(r[0]) for r in self.con.execute(
            f"SELECT t.shard_id {join} AND t.created_max = ?", (*args, top[0]))}
        row = self.con.execute("SELECT value FROM meta WHERE key = 'times_indexed_through'").fetchone()
        found.update(int(r[0]) for r in self.con.execute(
            f"SELECT s.shard_id FROM shards s WHERE s.shard_id > ? AND s.table_name = 'rollouts' AND {where_visible} "
            "AND NOT EXISTS (SELECT 1 FROM shard_times t WHERE t.shard_id = s.shard_id)",
            (-1 if row is None else int(row[0]), *args)))
        return found

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
        where_visible, args = visible(seq)
        if not self.has_table("shard_steps", con):
            return {int(r[0]) for r in con.execute(
                f"SELECT s.shard_id FROM shards s WHERE s.table_name = ? AND {where_visible}", (table, *args))}
        sql = ("SELECT s.shard_id FROM shard_steps x JOIN shards s ON s.shard_id = x.shard_id "
               f"WHERE x.table_name = ? AND x.run_id = ? AND {where_visible}")
        where: list = [table, run_id, *args]
        if first is not None:
            sql += " AND x.step_max >= ?"
            where.append(int(first))
        if last is not None:
            sql += " AND x.step_min <= ?"
            where.append(int(last))
        found = {int(r[0]) for r in con.execute(sql, where)}
        found.update(int(r[0]) for r in con.execute(
            f"SELECT s.shard_id FROM shards s WHERE s.shard_id > ? AND s.table_name = ? AND {where_visible} "
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
        but the pins of `pin_shards`. Portable SQL, on the dialect's clock."""
        clock, args = self.dialect.now()
        row = self.con.execute(f"SELECT min(seq) FROM pins WHERE expires_at > {clock} AND pin_id NOT LIKE ?",
                               (*args, SHARDS_PIN + "%")).fetchone()
        return None if row[0] is None else int(row[0])

    def _claim_ids(self, con, shard_id: int, pairs: Iterable[tuple[str, str]], groups: Iterable[str]) -> None:
        """Insert the ids (one row each); a taken one raises `CatalogConflict` (from the connection)."""
        con.executemany("INSERT INTO rollout_ids (rollout_id, group_id, shard_id) VALUES (?, ?, ?)",
                        ((r, g, shard_id) for r, g in pairs))
        con.executemany("INSERT INTO group_ids (group_id, shard_id) VALUES (?, ?)", ((g, shard_id) for g in groups))
