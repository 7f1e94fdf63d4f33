"""A DuckDB session over one snapshot, with rollstore's views, limits and the sandbox for user SQL.
The one session type of the project: a Dask task's session is the same class without a snapshot
(no table views; it reads what it loads, or one input shard as `rollouts`).

Invariants:
- Every table and user view (`groups`, `prompts`) reads the snapshot's file list, never a directory.
- After `lock()`: only files inside the buffer's data folders are readable (never the descriptor
  or the manifest at its root), extensions cannot be installed or loaded
  (autoload off), settings cannot change, and `run_user_sql` runs only statements that DuckDB itself
  types as SELECT — a `COPY`, `ATTACH`, `SET` or `PRAGMA` anywhere in the text refuses the whole text.
- Every refusal names the rule that refused it; a query past its timeout is interrupted.
- A user predicate (`check_predicate`) is accepted only if DuckDB parses it as exactly one
  expression (also when wrapped in parentheses, so no comment or parenthesis can escape the
  `WHERE (...)` it is pasted into) and it binds to BOOLEAN over `rollouts`.
- Errors of DuckDB in rollstore's own statements surface as one-line RollstoreErrors.
- The spill directory is `tmp/duckdb-<host>-<pid>-<random>`: `gc` removes those whose process is gone.
- A rebound session (`rebind`) shows its new snapshot only: the previous job's temp objects are
  gone, every table view reads the new snapshot's files, and views.sql's views, made once, read
  those views. The view of a table whose files changed is dropped and made again over the new
  files when a statement first names it (`bind`): until then it is absent, never the old one.
  The connection handed out (`con`) has every view made.
- Parquet footers are cached per session (`parquet_metadata_cache`: a loop's session rebinds to a new
  snapshot every iteration and scans the same immutable shards again). DuckDB re-reads a footer whose
  file changed since; a same-size change that also set the modification time back is the sha256
  check's to catch (every commit verifies its inputs first).
- A session pins the snapshot it reads (`Snapshot.hold`) until it is rebound or closed: a loop's
  session, kept between steps, reads its snapshot's files after the curation that bound it ended, and
  a `compact` then `gc` meanwhile removes none of them (a pin expires after an hour: a session idle
  longer may find its retired files gone). A rebind checks the presence of the shards its previous
  snapshot did not have (those it had were checked when it was bound and stay pinned): its cost
  follows what changed, not the buffer's shard count.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import threading
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator

import duckdb
import pyarrow as pa

from rollstore.storage.buffer import SUBDIRS
from rollstore.storage.errors import RollstoreError
from rollstore.storage.maintenance import spill_prefix
from rollstore.storage.schema import TABLES
from rollstore.storage.snapshot import MOVED_TABLE, Snapshot, register_empty, sql_string

from . import load_sql

DEFAULT_MEMORY_LIMIT = os.environ.get("ROLLSTORE_MEMORY_LIMIT", "2GB")
DEFAULT_TIMEOUT = 60.0


class SqlRefused(RollstoreError):
    """User SQL was refused by a sandbox rule (the message names the rule)."""


class SqlError(RollstoreError):
    """User SQL that DuckDB could not run (a mistyped table or column, a type error): one line, with
    DuckDB's "Did you mean ..." when it has one."""


class SqlTimeout(RollstoreError):
    """A query ran past its timeout and was interrupted."""


class MemoryLimitError(RollstoreError):
    """A memory limit was unreadable, or a query went past it."""


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


MIN_MEMORY_LIMIT = 16 * 2**20  # below it DuckDB cannot run a query at all
MAX_MEMORY_LIMIT = 2**50  # 1 PiB: beyond it DuckDB refuses the setting


def parse_memory_limit(text: str) -> int:
    """Bytes of a limit written like DuckDB's (`200MB`, `2GiB`, `1.5GB`), between 16 MiB and 1 PiB;
    refuses anything else."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise MemoryLimitError(f"memory limit {text!r}: expected a size such as 200MB, 2GB or 1GiB")
    value = int(float(m.group(1)) * _UNITS[unit])
    if not MIN_MEMORY_LIMIT <= value <= MAX_MEMORY_LIMIT:
        raise MemoryLimitError(f"memory limit {text!r}: must be between 16MiB and 1PiB")
    return value


def _table_keys(snapshot) -> dict[str, tuple]:
    """Per table, what its view is bound over (`Snapshot.table_keys`, `SnapshotFiles.table_keys`)."""
    return snapshot.table_keys()


# Tables and views.sql's objects (views and macros over the tables), by the words that name them.
_VIEWS_SQL_OBJECTS = frozenset(n.lower() for n in re.findall(r"CREATE OR REPLACE (?:VIEW|MACRO) (\w+)",
                                                            load_sql("views"), re.I))
_NAMES = re.compile(r"(?<![\w$])(" + "|".join(sorted(set(TABLES) | _VIEWS_SQL_OBJECTS, key=len, reverse=True))
                    + r")(?!\w)", re.I)


# What may reach a table without naming it as a word: a name built at run time (`query_table`,
# `query`), a dollar-quoted string, the catalog's listings.
_INDIRECT = re.compile(r"query_table|\bquery\s*\(|\$\$|information_schema|duckdb_|\bshow\b|\bdescribe\b|"
                       r"\bpragma\b|\bsummarize\b", re.I)


def tables_named(text: str) -> set[str]:
    """The tables `text` (SQL) may read: each table whose name appears in it as a word (in comments
    and strings too: a name too many costs a view made for nothing, one too few would fail the
    statement), and every table when it names one of views.sql's objects or may reach a table
    without naming it (`_INDIRECT`)."""
    named = {m.lower() for m in _NAMES.findall(text)}
    if named & _VIEWS_SQL_OBJECTS or _INDIRECT.search(text):
        return set(TABLES)
    return named & set(TABLES)


def _hold(snapshot) -> Callable[[], None]:
    """A pin of `snapshot` while a session reads it (`Snapshot.hold`), and its release; nothing for a
    frozen snapshot (its holder pins it) or none."""
    return snapshot.hold() if snapshot is not None else (lambda: None)


class Session:
    """DuckDB connection with views over `snapshot`. Close it (or use `with`) to drop its spill dir."""

    def __init__(
        self,
        snapshot: Snapshot | None,
        memory_limit: str = DEFAULT_MEMORY_LIMIT,
        threads: int | None = None,
        sandbox: bool = True,
        *,
        root: str | None = None,
        rollouts: str | None = None,
        long_lived: bool = False,
    ):
        """`snapshot=None` opens a session of the buffer at `root` with no table views: it reads
        what its caller loads, and `rollouts`, when given, is the one Parquet file seen as the
        `rollouts` view (a Dask task's session). Limits, spill folder and sandbox are the same.
        `long_lived`: a loop's session, rebound every step for thousands of steps, each reading new
        files once: DuckDB's caches of Parquet footers and of file blocks, which would keep every
        file's ever read (memory growing with the run), are off."""
        if (snapshot is None) == (root is None):
            raise ValueError("a Session needs either a snapshot or the root of a buffer")
        self.snapshot = snapshot
        self._release = _hold(snapshot)  # the snapshot's files stay until the session leaves it
        self.root = snapshot.root if snapshot is not None else root
        parse_memory_limit(memory_limit)
        self._con = duckdb.connect(":memory:")
        self.spill_dir = os.path.join(self.root, "tmp", f"{spill_prefix()}{uuid.uuid4().hex[:12]}")
        self._con.execute(f"SET memory_limit={sql_string(memory_limit)}")
        self._con.execute(f"SET temp_directory={sql_string(self.spill_dir)}")
        self._con.execute("SET preserve_insertion_order=false")
        # shards are immutable (see the invariants): a footer read is kept for the session's next reads
        self._con.execute(f"SET parquet_metadata_cache={'false' if long_lived else 'true'}")
        if long_lived:  # (likewise its cache of file blocks: an entry per file read, ~1 KB each, never dropped)
            self._con.execute("SET enable_external_file_cache=false")
        if threads:
            self._con.execute(f"SET threads={int(threads)}")
        self._bound: dict[str, tuple] = {}  # each table's view: what it was bound over (`_table_keys`)
        self._own: set[str] = set()  # what the table views (their tables: MOVED_TABLE) and views.sql make
        self._stale: set[str] = set()  # tables whose views a `rebind` left to make (`bind`)
        self._unchecked: set[str] = set()  # tables whose shards' presence no one checked yet (`bind` does)
        self._placeholders: set[str] = set()  # tables standing in for views not made yet (empty, same columns)
        if isinstance(snapshot, Snapshot):  # the views are made when a statement first names them (`bind`):
            register_empty(self._con, self.root)  # a resumed loop's first step lists no shard
            self._stale = self._unchecked = self._placeholders = set(TABLES)
            self._con.execute(load_sql("views"))
            self._bound = _table_keys(snapshot)
            self._own = {n for c, n, _ in self._objects() if c != "temp"} | set(TABLES) | {MOVED_TABLE}
        elif snapshot is not None:  # a listing (a Dask worker's): its files are at hand
            snapshot.register_duckdb(self._con)
            self._con.execute(load_sql("views"))
            self._bound = _table_keys(snapshot)
            self._own = {n for c, n, _ in self._objects() if c != "temp"} | set(TABLES) | {MOVED_TABLE}
        elif rollouts is not None:
            self._con.execute(f"CREATE VIEW rollouts AS SELECT * FROM read_parquet({sql_string(rollouts)}, "
                             "hive_partitioning = false)")
        self.locked = False
        if sandbox:
            self.lock()

    def lock(self) -> None:
        """Apply the sandbox: the buffer is the only readable place; settings locked."""
        con = self._con
        con.execute("SET autoinstall_known_extensions=false")
        con.execute("SET autoload_known_extensions=false")
        # the data folders only: the buffer's own files at its root (the catalog descriptor, whose DSN
        # may hold a password; the manifest) are never readable by user SQL (docs/integrity.md)
        folders = ", ".join(sql_string(os.path.join(self.root, d) + os.sep) for d in SUBDIRS)
        con.execute(f"SET allowed_directories=[{folders}]")
        con.execute("SET enable_external_access=false")
        con.execute("SET lock_configuration=true")
        self.locked = True

    def rebind(self, snapshot: Snapshot) -> "Session":
        """Point this open session at another snapshot of the same buffer, for one more job.

        Every temporary table and view of the previous job (and any other object that neither the
        table views nor views.sql made) is dropped in one script, and so is every table view whose
        files changed: it is made again over the new snapshot's files when a statement first names
        it (`bind`); the others read the same files already. Nothing of the previous job stays
        visible. views.sql's views and macros stay:
        DuckDB binds a view when it is read, so they read the new table views; no SQL of rollstore
        but views.sql creates an object outside the temp catalog (tests/test_storage_sql.py checks
        every query file and built-in recipe), and user SQL is SELECT-only. The settings (limits,
        sandbox) are kept. A loop pays the connection and views.sql once per run this way.
        """
        if snapshot.root != self.root:
            raise ValueError(f"a session of {self.root} cannot read {snapshot.root}")
        # Before anything is dropped: a missing file leaves the session as it was. The shards of the
        # snapshot it reads now were checked when it was bound, and its pin keeps them from gc: only the
        # others are checked (a loop's step: its new shards, not every shard of the run).
        previous = self.snapshot if isinstance(self.snapshot, Snapshot) and self.snapshot.root == snapshot.root else None
        snapshot.check_present(since=previous)
        release, self._release = self._release, _hold(snapshot)
        release()  # the earlier snapshot's pin: gc may take its retired files now
        keys = _table_keys(snapshot)
        changed = [name for name, key in keys.items() if self._bound.get(name) != key]
        drops = [f'DROP {"VIEW" if kind == "VIEW" else "TABLE"} IF EXISTS "{catalog}".main."{name}";'
                 for catalog, name, kind in self._objects()
                 if catalog == "temp" or name not in self._own or name in changed
                 or (name == MOVED_TABLE and "curated" in changed)]  # the curated view's table goes with it
        if drops:  # one script: a loop rebinds every iteration, and each statement has a fixed cost
            self._con.execute("\n".join(drops))
        self.snapshot = snapshot
        self._bound = keys
        self._stale = self._stale | set(changed)  # made when a statement first names them (`bind`)
        self._placeholders = self._placeholders - set(changed)  # (dropped above with the changed views)
        return self

    def bind(self, tables=None) -> None:
        """Make the views of `tables` (names; None: every table) that a `rebind` left to make. A
        loop's curation of a new step reads none of the eight tables' views: they are made by the first
        statement that names them, or never (the `curated` view, over every rollouts shard, cost
        3-4 ms to make at 20 iterations)."""
        wanted = self._stale if tables is None else self._stale.intersection(tables)
        if wanted:
            names = [t for t in TABLES if t in wanted]
            unchecked = [t for t in names if t in self._unchecked]
            if unchecked:  # (a new session's first use of them: every shard's presence, once)
                self.snapshot.check_present(unchecked)
            placeholders = [t for t in names if t in self._placeholders]
            db = self._con.execute("SELECT current_database()").fetchall()[0][0]
            schema = f'"{db}".main.'  # (not a temp object a caller made of the same name: `load`)
            if placeholders:
                self._con.execute("\n".join(f'DROP TABLE IF EXISTS {schema}"{t}";' for t in placeholders))
            self.snapshot.register_duckdb(self._con, names, checked=True, schema=schema)
            self._stale = self._stale - wanted
            self._unchecked = self._unchecked - wanted
            self._placeholders = self._placeholders - wanted

    def bind_named(self, text: str) -> None:
        """`bind` the tables that `text` (SQL) names, directly or through views.sql's objects."""
        if self._stale:
            self.bind(tables_named(text))

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The connection with every table view made (`bind`): whatever a caller reads through it
        is the snapshot's."""
        self.bind()
        return self._con

    def _objects(self) -> list[tuple[str, str, str]]:
        """(catalog, name, kind) of every table and view of the connection."""
        return self._con.execute(  # duckdb_tables()/duckdb_views(): a third of information_schema.tables' cost
            "SELECT database_name, table_name, 'TABLE' FROM duckdb_tables() WHERE schema_name = 'main' UNION ALL "
            "SELECT database_name, view_name, 'VIEW' FROM duckdb_views() WHERE NOT internal AND schema_name = 'main'"
        ).fetchall()

    def close(self) -> None:
        self._release()
        self._con.close()
        shutil.rmtree(self.spill_dir, ignore_errors=True)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def deadline(self, timeout: float | None) -> Iterator[None]:
        """Interrupt whatever runs on this connection after `timeout` seconds (None, 0: never).
        A timeout must be a finite number ≥ 0; one beyond what a timer can wait
        (`threading.TIMEOUT_MAX`) never fires, like no timeout."""
        if timeout is not None and not (timeout >= 0 and math.isfinite(timeout)):
            raise SqlTimeout(f"timeout {timeout!r}: expected a finite number of seconds ≥ 0")
        if not timeout or timeout >= threading.TIMEOUT_MAX:
            yield
            return
        fired = threading.Event()

        def fire() -> None:
            fired.set()
            self._con.interrupt()

        timer = threading.Timer(timeout, fire)
        timer.start()
        try:
            yield
        except duckdb.InterruptException:
            raise SqlTimeout(f"query stopped at the timeout of {timeout:g} s") from None
        finally:
            timer.cancel()
        if fired.is_set():
            raise SqlTimeout(f"query stopped at the timeout of {timeout:g} s")

    def execute(self, sql: str, params: dict | list | None = None, reads=None) -> duckdb.DuckDBPyConnection:
        """Run rollstore's own SQL (trusted: may create temp tables; it may embed a checked user
        predicate, whose run-time errors become one line here). `reads`: the tables it reads, when the
        caller declares them (a plan step); otherwise the tables its text names (`tables_named`)."""
        with self._errors():
            self.bind_named(sql) if reads is None else self.bind(reads)
            return self._con.execute(sql, params) if params is not None else self._con.execute(sql)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """DuckDB's errors of rollstore's own SQL as one line: a sandbox refusal, or an SQL error."""
        try:
            yield
        except duckdb.PermissionException as exc:
            raise SqlRefused(explain_permission(str(exc), self.root)) from None
        except duckdb.InterruptException:
            raise
        except duckdb.Error as exc:
            raise RollstoreError(f"SQL error: {_first_line(exc)}") from None

    def check_predicate(self, text: str, name: str = "where", rollouts: str = "rollouts") -> None:
        """Refuse `text` unless it is exactly one expression that binds to BOOLEAN over `rollouts` (the
        view, or a relation over the same files: a curation's, so that its session makes no view of
        `rollouts`, which costs a footer check per shard)."""
        for candidate in (text, f"({text})"):
            try:
                duckdb.SQLExpression(candidate)
            except duckdb.Error as exc:
                raise SqlRefused(f"{name}: not one SQL expression ({_first_line(exc)})") from None
        self.check_user_sql(f"SELECT * FROM rollouts WHERE ({text})")
        try:
            self.bind_named(text)
            self.bind({rollouts})  # nothing when a relation is given
            kind = self._con.sql(f"SELECT ({text}) AS predicate FROM {rollouts} AS rollouts LIMIT 0").types[0]
        except duckdb.PermissionException as exc:
            raise SqlRefused(explain_permission(str(exc), self.root)) from None
        except duckdb.Error as exc:
            raise SqlRefused(f"{name}: {_first_line(exc)}") from None
        if str(kind) not in ("BOOLEAN", '"NULL"', "NULL"):
            raise SqlRefused(f"{name}: must be a boolean expression, but {text!r:.80} is {kind}")

    def table(self, sql: str, params: dict | None = None, reads=None) -> "pa.Table":
        """The result of rollstore's own query as an Arrow table (errors and `reads` as in `execute`)."""
        with self._errors():
            self.bind_named(sql) if reads is None else self.bind(reads)
            return self._con.sql(sql, params=params or None).to_arrow_table()

    def load(self, name: str, table: "pa.Table") -> None:
        """Transport in: `table` becomes the temp table `name` (no SQL of a step involved)."""
        self._con.register("_incoming", table)
        try:
            self._con.execute(f'CREATE OR REPLACE TEMP TABLE "{name}" AS SELECT * FROM _incoming')
        finally:
            self._con.unregister("_incoming")

    def temp_tables(self) -> list[str]:
        """Names of this session's temp tables (not views), for transport between Dask tasks."""
        return [r[0] for r in self._con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE temporary AND table_name <> '_incoming' "
            "ORDER BY table_name").fetchall()]

    def unload(self, name: str) -> "pa.Table":
        """Transport out: the whole temp table or view `name` as Arrow."""
        return self.relation(name).to_arrow_table()

    def relation(self, name: str) -> duckdb.DuckDBPyRelation:
        """The table or view `name` as a DuckDB relation (a table's view made first)."""
        self.bind_named(name)
        return self._con.table(name)

    def one(self, sql: str, params: dict | list | None = None, reads=None) -> tuple | None:
        """First row of a query (fully consumed, so the connection is free for the next one)."""
        rows = self.execute(sql, params, reads).fetchall()
        return rows[0] if rows else None

    def threads(self) -> int:
        """DuckDB's worker threads in this session."""
        return int(self.one("SELECT current_setting('threads')")[0])

    def check_user_sql(self, sql: str) -> list[str]:
        """The statements of `sql` if every one is a SELECT; otherwise raise SqlRefused."""
        try:
            sql.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes that were not UTF-8 on the command line
            raise SqlRefused(f"SQL text is not valid UTF-8 (at character {exc.start})") from None
        try:
            statements = self._con.extract_statements(sql)
        except duckdb.Error as exc:
            raise SqlRefused(f"SQL does not parse: {_first_line(exc)}") from None
        if not statements:
            raise SqlRefused("no SQL statement given")
        for i, st in enumerate(statements, 1):
            if st.type != duckdb.StatementType.SELECT:
                kind = str(st.type).rsplit(".", 1)[-1]
                raise SqlRefused(
                    f"refused by the read-only rule: only SELECT statements may run "
                    f"(statement {i} is {kind})"
                )
        return [st.query for st in statements]

    def run_user_sql(self, sql: str, timeout: float | None = DEFAULT_TIMEOUT,
                     commits: "pa.Table | None" = None) -> "pa.Table":
        """Run user SQL under the sandbox and a timeout; returns the last statement's result.
        `commits`: the catalog's commit log (`Snapshot.commits`), read before a fork, as the view
        `commits` (seq, created_at, kind, detail, host); see `names_commits`."""
        if not self.locked:
            self.lock()
        statements = self.check_user_sql(sql)
        if commits is not None:
            self._con.register("commits", commits)
        with self.deadline(timeout):
            try:
                self.bind_named(sql)
                for query in statements[:-1]:
                    self._con.execute(query)
                result = self._con.sql(statements[-1]).to_arrow_table()
            except duckdb.PermissionException as exc:
                raise SqlRefused(explain_permission(str(exc), self.root)) from None
            except duckdb.InvalidInputException as exc:
                if "configuration has been locked" in str(exc):
                    raise SqlRefused("refused by the locked-settings rule: settings cannot change") from None
                raise SqlError(f"SQL error: {_first_line(exc)}") from None
            except duckdb.InterruptException:
                raise
            except duckdb.Error as exc:
                raise SqlError(f"SQL error: {_first_line(exc)}") from None
        return result


_COMMITS = re.compile(r"(?<![\w$])commits(?!\w)", re.I)


def names_commits(sql: str) -> bool:
    """True when user SQL may read the `commits` view (the catalog's commit log, not a Parquet table:
    read from the catalog only for the statements that name it, or may reach it indirectly)."""
    return bool(_COMMITS.search(sql) or _INDIRECT.search(sql))


def explain_permission(message: str, root: str) -> str:
    text = message.splitlines()[0]
    if "extension" in text.lower():
        return f"refused by the extension rule: extensions cannot be installed or loaded ({text})"
    return (f"refused by the file rule: only files inside the buffer {root}'s data folders ({', '.join(SUBDIRS)}) "
            f"may be read ({text})")


def _first_line(exc: BaseException) -> str:
    """DuckDB's message as one line: its first line, and its "Did you mean ..." line when it has one."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    hint = next((line for line in lines[1:] if line.lower().startswith("did you mean")), None)
    return f"{lines[0]} {hint}" if hint else lines[0]
