"""Rendering query results for the command line: table, csv, json, parquet.

Invariants: `json` is one JSON array of objects (lists as arrays, booleans as true/false, NULL and
NaN as null, timestamps as ISO-8601); `csv` is a header line then rows; `parquet` needs a file.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import sys

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

MAX_TABLE_ROWS = 1000


def _jsonable(value):
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):  # DuckDB's sum() of integers is HUGEINT -> decimal(38, 0)
        return int(value) if value.as_tuple().exponent >= 0 else float(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def to_json(table: pa.Table) -> str:
    return json.dumps([_jsonable(row) for row in table.to_pylist()], ensure_ascii=False)


def _csv_ready(table: pa.Table) -> pa.Table:
    """CSV cannot hold lists or structs: render them as JSON text."""
    cols = []
    for name, col in zip(table.column_names, table.columns):
        if pa.types.is_nested(col.type):
            col = pa.array([None if v is None else json.dumps(_jsonable(v)) for v in col.to_pylist()], pa.string())
        cols.append(col)
    return pa.Table.from_arrays(cols, names=table.column_names)


def _cell(value) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, list):
        text = json.dumps(_jsonable(value[:8]))
        return text[:-1] + (f", … ({len(value)})]" if len(value) > 8 else "]")
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_result(table: pa.Table, fmt: str, out_file: str | None, console: Console) -> None:
    if fmt == "parquet":
        pq.write_table(table, out_file, compression="zstd")
        return
    if fmt == "json":
        text = to_json(table) + "\n"
    elif fmt == "csv":
        sink = pa.BufferOutputStream()
        pacsv.write_csv(_csv_ready(table), sink)
        text = sink.getvalue().to_pybytes().decode()
    else:
        if out_file is None:
            render_table(table, console)
            return
        text = table.to_string(preview_cols=0) + "\n"
    if out_file:
        with open(out_file, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def render_table(table: pa.Table, console: Console, title: str | None = None) -> None:
    view = Table(title=title, show_lines=False)
    for name in table.column_names:
        view.add_column(name, overflow="fold")
    for row in table.slice(0, MAX_TABLE_ROWS).to_pylist():
        view.add_row(*(_cell(v) for v in row.values()))
    console.print(view)
    if table.num_rows > MAX_TABLE_ROWS:
        console.print(f"({table.num_rows} rows, first {MAX_TABLE_ROWS} shown; use --format csv or --out)")
