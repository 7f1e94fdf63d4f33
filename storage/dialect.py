"""The small differences between the catalog's two SQL databases, as named hooks.

`catalog_sql.SqlCatalog` writes each query once; where SQLite and PostgreSQL spell something
differently it asks its dialect (`SQLITE` or `POSTGRES`) instead of rewriting text:
- `prepare(sql)`: the parameter style (SQLite takes `?`; psycopg takes `%s`, so `%` is doubled);
- `upsert` / `insert_ignore`: `INSERT ... ON CONFLICT` (both databases spell it alike, once here);
- `greatest`: SQLite's two-argument `max(a, b)` is PostgreSQL's `GREATEST(a, b)`;
- `distinct`: "differs, nulls included" (`IS NOT` / `IS DISTINCT FROM`);
- `integer`: the integer type of a CAST;
- `now`: the clock of leases, pins and holds (SQLite: this host's, a parameter; PostgreSQL: the
  database's, so hosts' clocks need not agree);
- `has_table`: whether a table exists (`sqlite_master` / `to_regclass`);
- `in_list(column, values)`: membership in a list of parameters, in chunks the driver accepts.
Savepoints use the standard `SAVEPOINT x` / `ROLLBACK TO SAVEPOINT x` / `RELEASE SAVEPOINT x`,
which both accept; `RETURNING` is PostgreSQL's and `lastrowid` SQLite's (each sibling's own
statement where a new row's id is read). Which driver errors mean "busy, try again" is each
connection's own (`manifest.SqliteConnection`, `catalog_pg.PgConnection`), where it translates
them into `errors.CatalogError` and its kinds.

Invariant: no hook parses or rewrites SQL text; `prepare` changes the parameter marker alone.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Iterator, Sequence


@dataclass(frozen=True)
class Dialect:
    name: str
    greatest: str  # the two-argument maximum
    distinct: str  # "the two differ, a NULL differing from a value"
    integer: str  # the integer type of a CAST
    db_clock: bool  # True: `now` is the database's clock, else this host's (a parameter)
    chunk: int  # how many parameters one `in_list` carries
    array: bool  # True: `in_list` binds one array parameter (`= ANY(?)`), else one marker per value

    def prepare(self, sql: str) -> str:
        """`sql` (with `?` markers) in the driver's parameter style."""
        return _percent(sql) if self.name == "postgresql" else sql

    @staticmethod
    def upsert(table: str, cols: Sequence[str], keys: Sequence[str]) -> str:
        """INSERT of `cols` that replaces the other columns of the row whose `keys` already exist."""
        rest = [c for c in cols if c not in keys]
        return (f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
                f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in rest))

    @staticmethod
    def insert_ignore(table: str, cols: Sequence[str]) -> str:
        """INSERT of `cols` that does nothing where a row with the same key exists."""
        return (f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
                "ON CONFLICT DO NOTHING")

    def now(self) -> tuple[str, list]:
        """(the SQL of the clock's now, its parameters)."""
        if self.db_clock:
            return "extract(epoch FROM clock_timestamp())", []
        return "?", [time.time()]

    def has_table(self) -> str:
        """A query with one parameter (a table name) whose first value is true when the table exists."""
        if self.name == "postgresql":
            return "SELECT to_regclass(?) IS NOT NULL"
        return "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?"

    def in_list(self, column: str, values: Sequence, cast: str = "text") -> Iterator[tuple[str, list]]:
        """(`column` is one of a chunk of `values`, its parameters) for each chunk; none for no values."""
        values = list(values)
        for i in range(0, len(values), self.chunk):
            part = values[i:i + self.chunk]
            if self.array:
                yield f"{column} = ANY(?::{cast}[])", [part]
            else:
                yield f"{column} IN ({', '.join('?' * len(part))})", part


@functools.lru_cache(maxsize=1024)
def _percent(sql: str) -> str:
    return sql.replace("%", "%%").replace("?", "%s")


SQLITE = Dialect("sqlite", greatest="max", distinct="IS NOT", integer="INTEGER", db_clock=False, chunk=500,
                 array=False)
POSTGRES = Dialect("postgresql", greatest="GREATEST", distinct="IS DISTINCT FROM", integer="BIGINT", db_clock=True,
                   chunk=50_000, array=True)
