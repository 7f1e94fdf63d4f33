"""Read a user's JSONL or Parquet file of rollout rows into an Arrow table (before validation).

Invariants:
- Reading never writes; a file that cannot be read raises one ValidationError naming the file,
  and the line (JSONL) or the row's rollout_id and the column.
- Columns are converted to the contract's types here only as far as JSON needs (timestamps from ISO
  strings); every other rule is `validate.validate_rollouts`'s job.
- JSON values follow the type rule before Arrow sees them (`json_fits`): an integer column takes
  JSON integers only (never 1.5, nor 1.0), a float column integers or floats, a string column
  strings, a boolean column true/false; so nothing is truncated or turned into text on the way.
- Undecodable bytes and absurdly nested lines are one error line naming the file and the line.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import ValidationError
from .schema import ROLLOUTS

JSONL_CHUNK_ROWS = 20_000  # lines decoded into Python objects at a time, at most ...
JSONL_CHUNK_BYTES = 4 << 20  # ... and about this much JSON text (Python objects take ~5-10x)


def read_rows_file(path: str) -> pa.Table:
    if path.endswith(".parquet"):
        try:
            return pq.read_table(path)
        except (OSError, pa.ArrowException) as exc:
            raise ValidationError(path, None, None, f"not a readable Parquet file ({exc})") from None
    return read_jsonl(path)


def _parse_time(value, path: str, rid, column: str):
    if value is None or isinstance(value, dt.datetime):
        return value
    try:
        if isinstance(value, (int, float)):
            return dt.datetime.fromtimestamp(value, tz=dt.timezone.utc)
        parsed = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except (TypeError, ValueError, OverflowError):
        raise ValidationError(path, rid, column, f"{value!r} is not an ISO-8601 timestamp") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def json_fits(value, target: pa.DataType) -> bool:
    """Whether a decoded JSON value may go into a column of `target` (the type rule)."""
    if value is None:
        return True
    if pa.types.is_boolean(target):
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if pa.types.is_integer(target):
        return isinstance(value, int)
    if pa.types.is_floating(target):
        return isinstance(value, (int, float))
    if pa.types.is_string(target):
        return isinstance(value, str)
    if pa.types.is_list(target):
        return isinstance(value, list) and all(json_fits(v, target.value_type) for v in value)
    return True


def _json_kind(value) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def read_jsonl_objects(path: str) -> list[tuple[int, dict]]:
    """(line number, decoded object) for every non-blank line of a JSONL file; one error line
    naming the file and the line for unreadable bytes, invalid JSON or a line that is not an object."""
    return list(iter_jsonl_objects(path))


def iter_jsonl_objects(path: str, sizes: bool = False) -> Iterator[tuple]:
    """`read_jsonl_objects`, one line at a time (memory: one line); with `sizes`, each item also
    carries the line's length in bytes."""
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ValidationError(path, None, None, f"cannot open ({exc.strerror})") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValidationError(path, None, None, f"line {lineno}: not UTF-8 (byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValidationError(path, None, None, f"line {lineno}: invalid JSON ({exc.msg})") from None
            except RecursionError:
                raise ValidationError(path, None, None, f"line {lineno}: JSON nested too deeply") from None
            if not isinstance(row, dict):
                raise ValidationError(path, None, None, f"line {lineno}: expected a JSON object")
            yield (lineno, row, len(raw)) if sizes else (lineno, row)


def read_jsonl(path: str, chunk_rows: int = JSONL_CHUNK_ROWS, chunk_bytes: int = JSONL_CHUNK_BYTES) -> pa.Table:
    """The rows of a JSONL file as one Arrow table, parsed a chunk at a time (`chunk_rows` lines or
    about `chunk_bytes` of text): only one chunk is ever held as Python objects, the rest as Arrow
    arrays, so memory is about the Arrow size of the rows. Columns of the rollouts schema get its
    types; a column that is not in the schema is kept as nulls under its name (validation refuses
    it by name)."""
    chunks: list[dict[str, pa.Array]] = []
    lengths: list[int] = []
    names: dict[str, None] = {}
    batch: list[dict] = []
    size = 0
    for _, row, nbytes in iter_jsonl_objects(path, sizes=True):
        batch.append(row)
        size += nbytes
        if len(batch) == chunk_rows or size >= chunk_bytes:
            chunks.append(_chunk_arrays(batch, path, names))
            lengths.append(len(batch))
            batch, size = [], 0
    if batch or not chunks:
        chunks.append(_chunk_arrays(batch, path, names))
        lengths.append(len(batch))
    types = {f.name: f.type for f in ROLLOUTS}
    columns, fields = [], []
    for name in names:
        kind = types.get(name, pa.null())
        parts = [chunk.get(name) if name in chunk else pa.nulls(n, kind) for chunk, n in zip(chunks, lengths)]
        columns.append(pa.chunked_array(parts, type=kind))
        fields.append(pa.field(name, kind))
    del batch
    pa.default_memory_pool().release_unused()  # hand the chunks' scratch memory back
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def _chunk_arrays(rows: list[dict], path: str, all_names: dict[str, None]) -> dict[str, pa.Array]:
    """One chunk of decoded rows as Arrow arrays, the type rule checked value by value."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    all_names.update(names)
    types = {f.name: f.type for f in ROLLOUTS}
    arrays: dict[str, pa.Array] = {}
    for name in names:
        if name not in types:  # not in the schema: refused by name in validation
            arrays[name] = pa.nulls(len(rows))
            continue
        values = [row.get(name) for row in rows]
        target = types.get(name)
        if target is not None and pa.types.is_timestamp(target):
            values = [_parse_time(v, path, r.get("rollout_id"), name) for v, r in zip(values, rows)]
        elif target is not None:
            for v, r in zip(values, rows):
                if not json_fits(v, target):
                    rid = r.get("rollout_id")
                    raise ValidationError(path, None if rid is None else str(rid), name,
                                          f"expected {target}, got JSON {_json_kind(v)} {v!r:.60}")
        try:
            arr = pa.array(values, type=target) if target is not None else pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as exc:
            bad = _first_bad(values, target)
            rid = rows[bad].get("rollout_id") if bad is not None else None
            raise ValidationError(
                path, None if rid is None else str(rid), name,
                f"expected {target}, got {values[bad]!r:.60}" if bad is not None else str(exc),
            ) from None
        arrays[name] = arr
    return arrays


def _first_bad(values: list, target) -> int | None:
    for i, v in enumerate(values):
        try:
            pa.array([v], type=target)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
            return i
    return None
