"""A DuckDB session over one snapshot, with rollstore's views, limits and the sandbox for user SQL.

Invariants:
- Every table and user view (`groups`, `prompts`) reads the snapshot's file list, never a directory.
- After `lock()`: only files inside the buffer are readable, extensions cannot be installed or loaded
  (autoload off), settings cannot change, and `run_user_sql` runs only statements that DuckDB itself
  types as SELECT — a `COPY`, `ATTACH`, `SET` or `PRAGMA` anywhere in the text refuses the whole text.
- Every refusal names the rule that refused it; a query past its timeout is interrupted.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from contextlib import contextmanager
from typing import Iterator

import duckdb
import pyarrow as pa

from storage.errors import RollstoreError
from storage.snapshot import Snapshot, sql_string

from . import load_sql

DEFAULT_MEMORY_LIMIT = os.environ.get("ROLLSTORE_MEMORY_LIMIT", "2GB")
DEFAULT_TIMEOUT = 60.0


class SqlRefused(RollstoreError):
    """User SQL was refused by a sandbox rule (the message names the rule)."""


class SqlTimeout(RollstoreError):
    """A query ran past its timeout and was interrupted."""


class Session:
    """DuckDB connection with views over `snapshot`. Close it (or use `with`) to drop its spill dir."""

    def __init__(
        self,
        snapshot: Snapshot,
        memory_limit: str = DEFAULT_MEMORY_LIMIT,
        threads: int | None = None,
        sandbox: bool = True,
    ):
        self.snapshot = snapshot
        self.root = snapshot.root
        self.con = duckdb.connect(":memory:")
        self.spill_dir = os.path.join(self.root, "tmp", f"duckdb-{uuid.uuid4().hex[:12]}")
        self.con.execute(f"SET memory_limit={sql_string(memory_limit)}")
        self.con.execute(f"SET temp_directory={sql_string(self.spill_dir)}")
        self.con.execute("SET preserve_insertion_order=false")
        if threads:
            self.con.execute(f"SET threads={int(threads)}")
        snapshot.register_duckdb(self.con)
        self.con.execute(load_sql("views"))
        self.locked = False
        if sandbox:
            self.lock()

    def lock(self) -> None:
        """Apply the sandbox: the buffer is the only readable place; settings locked."""
        con = self.con
        con.execute("SET autoinstall_known_extensions=false")
        con.execute("SET autoload_known_extensions=false")
        con.execute(f"SET allowed_directories=[{sql_string(self.root + os.sep)}]")
        con.execute("SET enable_external_access=false")
        con.execute("SET lock_configuration=true")
        self.locked = True

    def close(self) -> None:
        self.con.close()
        shutil.rmtree(self.spill_dir, ignore_errors=True)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def deadline(self, timeout: float | None) -> Iterator[None]:
        """Interrupt whatever runs on this connection after `timeout` seconds."""
        if not timeout:
            yield
            return
        fired = threading.Event()

        def fire() -> None:
            fired.set()
            self.con.interrupt()

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

    def execute(self, sql: str, params: dict | list | None = None) -> duckdb.DuckDBPyConnection:
        """Run rollstore's own SQL (trusted: may create temp tables)."""
        return self.con.execute(sql, params) if params is not None else self.con.execute(sql)

    def one(self, sql: str, params: dict | list | None = None) -> tuple | None:
        """First row of a query (fully consumed, so the connection is free for the next one)."""
        rows = self.execute(sql, params).fetchall()
        return rows[0] if rows else None

    def check_user_sql(self, sql: str) -> list[str]:
        """The statements of `sql` if every one is a SELECT; otherwise raise SqlRefused."""
        try:
            statements = self.con.extract_statements(sql)
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

    def run_user_sql(self, sql: str, timeout: float | None = DEFAULT_TIMEOUT) -> "pa.Table":
        """Run user SQL under the sandbox and a timeout; returns the last statement's result."""
        if not self.locked:
            self.lock()
        statements = self.check_user_sql(sql)
        with self.deadline(timeout):
            try:
                for query in statements[:-1]:
                    self.con.execute(query)
                result = self.con.sql(statements[-1]).to_arrow_table()
            except duckdb.PermissionException as exc:
                raise SqlRefused(explain_permission(str(exc), self.root)) from None
            except duckdb.InvalidInputException as exc:
                if "configuration has been locked" in str(exc):
                    raise SqlRefused("refused by the locked-settings rule: settings cannot change") from None
                raise RollstoreError(f"SQL error: {_first_line(exc)}") from None
            except duckdb.InterruptException:
                raise
            except duckdb.Error as exc:
                raise RollstoreError(f"SQL error: {_first_line(exc)}") from None
        return result


def explain_permission(message: str, root: str) -> str:
    text = message.splitlines()[0]
    if "extension" in text.lower():
        return f"refused by the extension rule: extensions cannot be installed or loaded ({text})"
    return f"refused by the file rule: only files inside the buffer {root} may be read ({text})"


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
