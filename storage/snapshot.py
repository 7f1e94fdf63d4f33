"""Readers over one snapshot of a buffer: DuckDB views, Polars LazyFrames, pyarrow Datasets.

Invariants:
- A snapshot is a manifest sequence number; its file list comes from the manifest, never from
  listing a directory, so a reader sees exactly the shards committed at that seq while writers go on.
- Every table of `schema.TABLES` is readable, also when it has no shard yet (an empty relation of
  the contract's schema).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.dataset as ds

from .manifest import Manifest, Shard
from .schema import TABLES

if TYPE_CHECKING:
    import duckdb
    import polars as pl


def sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class Snapshot:
    """The buffer as of manifest commit `seq`. Use as a context manager to pin it against gc."""

    def __init__(self, root: str, manifest: Manifest, seq: int, pin: bool = False):
        self.root = root
        self.seq = seq
        self._manifest = manifest
        self._shards = {name: manifest.shards(name, seq) for name in TABLES}
        self._pin = manifest.pin(seq) if pin else None

    def close(self) -> None:
        if self._pin is not None:
            self._manifest.unpin(self._pin)
            self._pin = None

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def shards(self, table: str) -> list[Shard]:
        return list(self._shards[table])

    def files(self, table: str) -> list[str]:
        return [os.path.join(self.root, s.path) for s in self._shards[table]]

    def rows(self, table: str) -> int:
        return sum(s.rows for s in self._shards[table])

    def arrow(self, table: str) -> ds.Dataset:
        files = self.files(table)
        if not files:
            return ds.dataset(pa.Table.from_batches([], schema=TABLES[table]))
        return ds.dataset(files, schema=TABLES[table], format="parquet")

    def polars(self, table: str) -> "pl.LazyFrame":
        import polars as pl

        files = self.files(table)
        if not files:
            return pl.from_arrow(pa.Table.from_batches([], schema=TABLES[table])).lazy()
        return pl.scan_parquet(files)

    def register_duckdb(self, con: "duckdb.DuckDBPyConnection", tables: list[str] | None = None) -> None:
        """Create a view per table (named as the table) over this snapshot's files."""
        for name in tables or list(TABLES):
            files = self.files(name)
            if files:
                listing = ", ".join(sql_string(f) for f in files)
                con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM read_parquet([{listing}])")
            else:
                empty = pa.Table.from_batches([], schema=TABLES[name])
                con.register(f"_empty_{name}", empty)
                con.execute(f"CREATE OR REPLACE TABLE {name} AS SELECT * FROM _empty_{name}")
                con.unregister(f"_empty_{name}")
