"""Validation of rollout rows before an append (docs/schema.md §Validation at append, in its order).

Invariants:
- `validate_rollouts` either returns a table that conforms exactly to `ROLLOUTS` or raises one
  `ValidationError` naming the file, the first offending row's rollout_id and the column.
- Checks run in that section's order; within a check, the first row in file order is reported.
- Uniqueness against the buffer is checked through a callable, so this module needs no manifest.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import ValidationError
from .schema import FINISH_REASONS, ROLLOUTS, TOKEN_LIST_COLUMNS

# String ids that must not be empty, and timestamps that must lie in years 1-9999 UTC (what Python,
# Arrow and DuckDB all represent).
ID_COLUMNS = ("rollout_id", "group_id", "prompt_id", "run_id")
TIMESTAMP_COLUMNS = ("created_at",)
MIN_MICROS = -62135596800 * 10**6  # 0001-01-01T00:00:00Z
MAX_MICROS = 253402300800 * 10**6 - 1  # 9999-12-31T23:59:59.999999Z

# Given rollout ids and group ids, return those already in the buffer.
ExistingLookup = Callable[[list[str], list[str]], tuple[set[str], set[str]]]


def _rid(table: pa.Table, row: int) -> str | None:
    if "rollout_id" not in table.column_names or row is None:
        return None
    value = table.column("rollout_id")[row].as_py()
    return None if value is None else str(value)


def _first_true(mask: pa.ChunkedArray | pa.Array) -> int | None:
    arr = np.asarray(pc.fill_null(mask, False).to_numpy(zero_copy_only=False), dtype=bool)
    idx = np.flatnonzero(arr)
    return int(idx[0]) if idx.size else None


def lossless_kind(src: pa.DataType, dst: pa.DataType) -> bool:
    """The type rule: `src` may become `dst` only if it is the same type, or a numeric cast that
    loses nothing for values that pass the safe cast (a wider integer into a narrower one whose
    range is then checked, an integer into a float, float64 narrowed to float32). Never a float
    into an integer, a number into a string, a string into a number."""
    if src == dst or pa.types.is_null(src):
        return True
    if pa.types.is_dictionary(src):
        return lossless_kind(src.value_type, dst)
    if pa.types.is_integer(dst):
        return pa.types.is_integer(src)
    if pa.types.is_floating(dst):
        return pa.types.is_integer(src) or pa.types.is_floating(src)
    if pa.types.is_string(dst):
        return pa.types.is_string(src) or pa.types.is_large_string(src)
    if pa.types.is_timestamp(dst):
        return pa.types.is_timestamp(src)
    if pa.types.is_list(dst):
        return (pa.types.is_list(src) or pa.types.is_large_list(src)) and lossless_kind(src.value_type, dst.value_type)
    return False


def conform(table: pa.Table, file: str) -> pa.Table:
    """Rule 1: required columns present, of the contract's types under the type rule
    (`lossless_kind`, then a safe cast), no nulls where banned."""
    n = table.num_rows
    columns = []
    for field in ROLLOUTS:
        if field.name not in table.column_names:
            if not field.nullable:
                raise ValidationError(file, None, field.name, "required column is missing")
            columns.append(pa.nulls(n, field.type))
            continue
        col = table.column(field.name)
        if not lossless_kind(col.type, field.type):  # every non-null value is of the wrong type
            raise ValidationError(file, _rid(table, _first_true(pc.is_valid(col))), field.name,
                                  f"expected {field.type}, got {col.type} (only lossless numeric casts are accepted)")
        if col.type != field.type:
            try:
                col = col.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                row = _first_bad_cast(col, field.type)
                raise ValidationError(
                    file, _rid(table, row) if row is not None else None, field.name,
                    f"expected {field.type}, got {col.type} ({str(exc).splitlines()[0]})",
                ) from None
        if not field.nullable and col.null_count:
            row = _first_true(pc.is_null(col))
            raise ValidationError(file, _rid(table, row), field.name, "null in a non-nullable column")
        if pa.types.is_list(field.type):  # also in nullable list columns that hold null lists
            col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            flat = pc.list_flatten(col)
            if flat.null_count:
                parents = pc.list_parent_indices(col)
                bad = _first_true(pc.is_null(flat))
                row = int(parents[bad].as_py())
                raise ValidationError(file, _rid(table, row), field.name, "null element in a list")
        columns.append(col)
    extra = [c for c in table.column_names if c not in ROLLOUTS.names]
    if extra:
        raise ValidationError(file, None, extra[0], "unknown column (not in the rollouts schema)")
    return pa.Table.from_arrays(columns, schema=ROLLOUTS)


def _first_bad_cast(col: pa.ChunkedArray, target: pa.DataType) -> int | None:
    offset = 0
    for chunk in col.chunks:
        for i in range(len(chunk)):
            try:
                chunk.slice(i, 1).cast(target, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                return offset + i
        offset += len(chunk)
    return None


def _raise_first(table: pa.Table, file: str, faults: list[tuple[int, str, str]]) -> None:
    """Raise for the earliest row among (row, column, message) faults of one check (column order breaks ties)."""
    if faults:
        row, name, msg = min(faults, key=lambda f: f[0])  # min() keeps the first of equal rows
        raise ValidationError(file, _rid(table, row), name, msg)


def _check_lengths(table: pa.Table, file: str) -> None:
    ref = pc.list_value_length(table.column("response_token_ids"))
    faults = []
    for name in TOKEN_LIST_COLUMNS:
        lengths = pc.list_value_length(table.column(name))
        row = _first_true(pc.not_equal(lengths, ref))
        if row is not None:
            faults.append((row, name,
                           f"has {lengths[row].as_py()} values but response_token_ids has {ref[row].as_py()}"))
    _raise_first(table, file, faults)


def _float_rows(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Values of a float column (flattened for lists) and the row each value belongs to."""
    col = table.column(name)
    if pa.types.is_list(col.type):
        col = col.combine_chunks()
        values = pc.list_flatten(col).to_numpy(zero_copy_only=False)
        rows = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
        return np.asarray(values, dtype=np.float32), np.asarray(rows)
    values = pc.fill_null(col, 0.0).to_numpy(zero_copy_only=False)
    return np.asarray(values, dtype=np.float32), np.arange(len(values))


def _first_fault(name: str, bad: np.ndarray, rows: np.ndarray, msg: str) -> list[tuple[int, str, str]]:
    return [(int(rows[np.flatnonzero(bad)].min()), name, msg)] if bad.any() else []


def validate_rollouts(
    table: pa.Table, file: str, existing: ExistingLookup | None = None
) -> pa.Table:
    """Return `table` conformed to ROLLOUTS, or raise the first ValidationError in docs/schema.md's order."""
    table = conform(table, file)
    if table.num_rows == 0:
        raise ValidationError(file, None, None, "no rows to append")
    _check_lengths(table, file)
    float_cols = ("reward",) + TOKEN_LIST_COLUMNS
    values = {name: _float_rows(table, name) for name in float_cols}
    faults = []  # no NaN or infinity
    for name in float_cols:
        vals, rows = values[name]
        faults += _first_fault(name, ~np.isfinite(vals), rows, "NaN or infinity")
    _raise_first(table, file, faults)
    faults = []  # bounds
    for name in ("gen_logprobs", "old_logprobs"):
        vals, rows = values[name]
        faults += _first_fault(name, vals > 0, rows, "log-probability above 0")
    vals, rows = values["entropies"]
    faults += _first_fault("entropies", vals < 0, rows, "negative entropy")
    for name in ("prompt_token_ids", "response_token_ids"):
        col = table.column(name).combine_chunks()
        ids = np.asarray(pc.list_flatten(col).to_numpy(zero_copy_only=False))
        rows = np.asarray(pc.list_parent_indices(col).to_numpy(zero_copy_only=False))
        faults += _first_fault(name, ids < 0, rows, "negative token id")
    for name in ID_COLUMNS:
        row = _first_true(pc.equal(pc.utf8_length(table.column(name)), 0))
        if row is not None:
            faults.append((row, name, "empty id"))
    for name in TIMESTAMP_COLUMNS:
        micros = pc.cast(table.column(name), pa.int64())
        row = _first_true(pc.or_(pc.less(micros, MIN_MICROS), pc.greater(micros, MAX_MICROS)))
        if row is not None:
            faults.append((row, name, "timestamp outside years 1-9999 UTC"))
    allowed = pa.array(list(FINISH_REASONS))
    row = _first_true(pc.invert(pc.is_in(table.column("finish_reason"), value_set=allowed)))
    if row is not None:
        faults.append((row, "finish_reason",
                       f"{table.column('finish_reason')[row].as_py()!r} is not one of {', '.join(FINISH_REASONS)}"))
    _raise_first(table, file, faults)
    _check_unique(table, file, existing)
    _check_agreement(table, file)
    return table


def _check_unique(table: pa.Table, file: str, existing: ExistingLookup | None) -> None:
    """rollout_id and (group_id, sample_idx) unique in the append and the buffer; groups are new.

    Reports the first row (in file order) that breaks any of them."""
    rids = table.column("rollout_id").to_pylist()
    gids = table.column("group_id").to_pylist()
    idxs = table.column("sample_idx").to_pylist()
    old_rids, old_gids = existing(rids, sorted(set(gids))) if existing is not None else (set(), set())
    seen: set[str] = set()
    pairs: set[tuple[str, int]] = set()
    for rid, gid, idx in zip(rids, gids, idxs):
        if rid in seen:
            raise ValidationError(file, rid, "rollout_id", "duplicate rollout_id in this append")
        if rid in old_rids:
            raise ValidationError(file, rid, "rollout_id", "rollout_id already in the buffer")
        if (gid, idx) in pairs:
            raise ValidationError(file, rid, "sample_idx", f"(group_id, sample_idx) = ({gid!r}, {idx}) repeated")
        if gid in old_gids:
            raise ValidationError(
                file, rid, "group_id",
                f"group {gid!r} is already in the buffer (a group's rows arrive in one append)",
            )
        seen.add(rid)
        pairs.add((gid, idx))


def _check_agreement(table: pa.Table, file: str) -> None:
    cols = ("prompt_id", "prompt", "run_id", "step", "policy_version")
    data = {c: table.column(c).to_pylist() for c in ("rollout_id", "group_id") + cols}
    first: dict[str, int] = {}
    for i, gid in enumerate(data["group_id"]):
        j = first.setdefault(gid, i)
        for c in cols:
            if data[c][i] != data[c][j]:
                raise ValidationError(
                    file, data["rollout_id"][i], c,
                    f"group {gid!r} disagrees on {c}: {data[c][i]!r:.60} vs {data[c][j]!r:.60}",
                )
