"""Rendering query results for the command line: table, csv, json, parquet.

Invariants: `json` is one JSON array of objects (lists as arrays, booleans as true/false, NULL and
NaN as null, timestamps as ISO-8601); `csv` is a header line then rows, a value quoted only when
it holds a comma, a quote or a line break; `parquet` needs a file.
Values Python cannot hold (DuckDB's infinite or far timestamps and dates) are rendered as text
(`infinity`, `-infinity`, or the ISO form), binary as hex in csv and json, never a crash. Table
cells are data: rich markup in them is printed literally, never interpreted.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

MAX_TABLE_ROWS = 1000


def jsonable(value):
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):  # DuckDB's sum() of integers is HUGEINT -> decimal(38, 0)
        return int(value) if value.as_tuple().exponent >= 0 else float(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value


def _temporal_text(col: pa.ChunkedArray) -> pa.Array:
    """A timestamp or date column as ISO text, valid for any stored value (infinities included)."""
    if pa.types.is_date32(col.type):
        raw, unit, top = col.cast(pa.int32()), "D", np.iinfo(np.int32).max
    elif pa.types.is_date64(col.type):
        raw, unit, top = col.cast(pa.int64()), "ms", np.iinfo(np.int64).max
    else:
        raw, unit, top = col.cast(pa.int64()), col.type.unit, np.iinfo(np.int64).max
    ints = np.asarray(raw.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    valid = np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), dtype=bool)
    out = []
    for v, ok in zip(ints, valid):
        if not ok:
            out.append(None)
        elif v == top:
            out.append("infinity")
        elif v == -top:
            out.append("-infinity")
        else:
            out.append(str(np.datetime64(int(v), unit)))
    return pa.array(out, pa.string())


def _python_safe(table: pa.Table) -> pa.Table:
    """Temporal columns whose values Python's datetime cannot hold become text (see invariants)."""
    cols = []
    for col in table.columns:
        if pa.types.is_timestamp(col.type) or pa.types.is_date(col.type):
            try:
                col.to_pylist()
            except (ValueError, OverflowError, pa.ArrowException):
                col = _temporal_text(col)
        cols.append(col)
    return pa.Table.from_arrays(cols, names=table.column_names)


def to_json(table: pa.Table) -> str:
    return json.dumps([jsonable(row) for row in _python_safe(table).to_pylist()], ensure_ascii=False)


def csv_ready(table: pa.Table) -> pa.Table:
    """CSV cannot hold lists or structs: render them as JSON text."""
    cols = []
    table = _python_safe(table)
    for name, col in zip(table.column_names, table.columns):
        if pa.types.is_nested(col.type):
            col = pa.array([None if v is None else json.dumps(jsonable(v)) for v in col.to_pylist()], pa.string())
        elif pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type) or pa.types.is_fixed_size_binary(col.type):
            col = pa.array([None if v is None else v.hex() for v in col.to_pylist()], pa.string())
        cols.append(col)
    return pa.Table.from_arrays(cols, names=table.column_names)


def csv_text(table: pa.Table) -> str:
    """`table` as CSV text: a header line, then rows; a value is quoted only when it must be (it
    holds a comma, a quote or a line break), so an id read from it is the id itself."""
    table = csv_ready(table)
    sink = pa.BufferOutputStream()
    try:
        pacsv.write_csv(table, sink, pacsv.WriteOptions(quoting_style="none"))
        return sink.getvalue().to_pybytes().decode()
    except pa.ArrowInvalid:  # some value needs quotes: quote those alone
        import csv
        import io

        text = io.StringIO()
        writer = csv.writer(text, quoting=csv.QUOTE_MINIMAL, lineterminator="\n")
        writer.writerow(table.column_names)
        cols = [pc.cast(c, pa.string()).to_pylist() for c in table.columns]
        writer.writerows(zip(*cols))
        return text.getvalue()


def _cell(value) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, list):
        text = json.dumps(jsonable(value[:8]))
        return text[:-1] + (f", … ({len(value)})]" if len(value) > 8 else "]")
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_result(table: pa.Table, fmt: str, out_file: str | None, console: Console) -> None:
    """Print `table`, or write it to `out_file` through `outfile.write_output` (a regular file
    only, replaced atomically)."""
    from rollstore.output.outfile import write_output

    if fmt == "parquet":
        write_output(out_file, lambda partial: pq.write_table(table, partial, compression="zstd"))
        return
    if fmt == "json":
        text = to_json(table) + "\n"
    elif fmt == "csv":
        text = csv_text(table)
    else:
        if out_file is None:
            render_table(table, console)
            return
        text = _python_safe(table).to_string(preview_cols=0) + "\n"
    if out_file:
        def write(partial: str) -> None:
            with open(partial, "x", encoding="utf-8") as fh:
                fh.write(text)

        write_output(out_file, write)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def render_table(table: pa.Table, console: Console, title: str | None = None) -> None:
    view = Table(title=Text(title) if title else None, show_lines=False)
    for name in table.column_names:
        view.add_column(Text(name), overflow="fold")
    for row in _python_safe(table.slice(0, MAX_TABLE_ROWS)).to_pylist():
        view.add_row(*(Text(_cell(v)) for v in row.values()))  # literal text, never markup
    console.print(view)
    if table.num_rows > MAX_TABLE_ROWS:
        console.print(f"({table.num_rows} rows, first {MAX_TABLE_ROWS} shown; use --format csv or --out)")
