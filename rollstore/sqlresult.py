"""The result of `Buffer.sql(...)`: an Arrow table that turns into Polars, Arrow or pandas in one call.

Invariants: the rows are computed once, when the query runs (the snapshot may change after);
`.pl()`, `.arrow()`, `.df()` convert those rows and never run the query again; the repr fits on a
screen (a shape line and at most 10 rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    import pandas
    import polars


class SqlResult:
    """Rows of one query over one snapshot of a buffer (`snapshot_seq`)."""

    def __init__(self, table: pa.Table, query: str, snapshot_seq: int):
        self._table = table
        self.query = query
        self.snapshot_seq = snapshot_seq

    def arrow(self) -> pa.Table:
        """The rows as a pyarrow Table."""
        return self._table

    def pl(self) -> "polars.DataFrame":
        """The rows as a Polars DataFrame."""
        import polars as pl

        return pl.from_arrow(self._table)

    def df(self) -> "pandas.DataFrame":
        """The rows as a pandas DataFrame (needs pandas installed)."""
        return self._table.to_pandas()

    def fetchall(self) -> list[tuple]:
        """The rows as a list of tuples (as DuckDB's `fetchall`)."""
        cols = [c.to_pylist() for c in self._table.columns]
        return list(zip(*cols))

    @property
    def columns(self) -> list[str]:
        """The result's column names."""
        return self._table.column_names

    def __len__(self) -> int:
        return self._table.num_rows

    def __repr__(self) -> str:
        t = self._table
        head = f"<SqlResult {t.num_rows} rows × {t.num_columns} columns, snapshot {self.snapshot_seq}>"
        try:
            import polars as pl

            with pl.Config(tbl_rows=10, tbl_cols=8, fmt_str_lengths=40):
                return head + "\n" + repr(pl.from_arrow(self._table.slice(0, 10)))
        except Exception:  # noqa: BLE001 - a repr never fails
            return head
