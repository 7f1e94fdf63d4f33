"""Validation of rollout rows before an append (docs/schema.md §Validation at append, in its order).

Invariants:
- `validate_rollouts` either returns a table that conforms exactly to `ROLLOUTS` or raises one
  `ValidationError` naming the file, the first offending row's rollout_id and the column.
- Checks run in that section's order; within a check, the first row in file order is reported.
- Uniqueness against the buffer is checked through a callable, so this module needs no manifest.
"""

from __future__ import annotations

import unicodedata
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import ValidationError
from .schema import FINISH_REASONS, ROLLOUTS, TOKEN_LIST_COLUMNS

# String ids that must not be empty, blank or hold invisible characters, and timestamps that must
# lie in years 1-9999 UTC (what Python, Arrow and DuckDB all represent).
ID_COLUMNS = ("rollout_id", "group_id", "prompt_id", "run_id")
# Integer columns that count from 0: a negative value is a sentinel or a bug, never data.
NON_NEGATIVE = ("sample_idx", "step", "policy_version")
# In an id: control characters (Cc), format characters (Cf: bidi embeddings, overrides and
# isolates, zero-width spaces and joiners, the BOM, soft hyphens) and line/paragraph separators.
# They make two different ids print the same, or reorder the text of the line that shows them.
INVISIBLE = r"[\p{Cc}\p{Cf}\p{Zl}\p{Zp}]"
BLANK = r"^[\s\p{Z}]*$"  # only whitespace (any Unicode space)
# Rows handed to the buffer's id lookup at a time (bounded memory for big appends).
LOOKUP_CHUNK = 50_000
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
            col = col if isinstance(col, pa.ChunkedArray) else pa.chunked_array([col])
            row = first_row_where(col, pc.is_null)  # chunk by chunk: no copy of the column
            if row is not None:
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


SLICE_ROWS = 65_536  # rows checked at a time: temporaries stay small whatever the append's size


def first_row_where(col: pa.ChunkedArray, test) -> int | None:
    """The first row (file order) of a scalar or list column holding a value for which `test`
    (an Arrow compute function over values) is true, looking at SLICE_ROWS rows at a time."""
    offset = 0
    for chunk in col.chunks:
        for start in range(0, len(chunk), SLICE_ROWS):
            part = chunk.slice(start, SLICE_ROWS)
            if pa.types.is_list(part.type):
                at = _first_true(test(pc.list_flatten(part)))
                if at is not None:
                    return offset + start + int(pc.list_parent_indices(part)[at].as_py())
            else:
                at = _first_true(test(part))
                if at is not None:
                    return offset + start + at
        offset += len(chunk)
    return None


def _fault(table: pa.Table, name: str, test, msg: str) -> list[tuple[int, str, str]]:
    row = first_row_where(table.column(name), test)
    return [] if row is None else [(row, name, msg)]


def check_finite(table: pa.Table, file: str) -> None:
    """Raise the first NaN or infinity of a rollouts table's floats (`reward` and the per-token
    log-probs and entropies) as one ValidationError; `Buffer.commit` applies it to every rollouts
    shard it writes, so no path into a rollouts shard skips it."""
    faults = []
    for name in ("reward",) + TOKEN_LIST_COLUMNS:
        if name in table.column_names:
            faults += _fault(table, name, lambda v: pc.invert(pc.is_finite(v)), "NaN or infinity")
    _raise_first(table, file, faults)


def validate_rollouts(
    table: pa.Table, file: str, existing: ExistingLookup | None = None
) -> pa.Table:
    """Return `table` conformed to ROLLOUTS, or raise the first ValidationError in docs/schema.md's order."""
    table = conform(table, file)
    if table.num_rows == 0:
        raise ValidationError(file, None, None, "no rows to append")
    _check_lengths(table, file)
    check_finite(table, file)  # the values are float32 already: checked after the narrowing
    faults = []  # bounds
    for name in ("gen_logprobs", "old_logprobs"):
        faults += _fault(table, name, lambda v: pc.greater(v, 0), "log-probability above 0")
    faults += _fault(table, "entropies", lambda v: pc.less(v, 0), "negative entropy")  # -0.0 is 0
    for name in ("prompt_token_ids", "response_token_ids"):
        faults += _fault(table, name, lambda v: pc.less(v, 0), "negative token id")
    for name in NON_NEGATIVE:
        row = _first_true(pc.less(table.column(name), 0))
        if row is not None:
            faults.append((row, name, f"{table.column(name)[row].as_py()} is negative (must be ≥ 0)"))
    for name in ID_COLUMNS:
        col = table.column(name)
        row = _first_true(pc.equal(pc.utf8_length(col), 0))
        if row is not None:
            faults.append((row, name, "empty id"))
        row = _first_true(pc.match_substring_regex(col, BLANK))
        if row is not None:
            faults.append((row, name, "blank id (only whitespace)"))
        row = _first_true(pc.match_substring_regex(col, INVISIBLE))
        if row is not None:
            bad = next(ch for ch in col[row].as_py() if _invisible(ch))
            faults.append((row, name, f"id holds an invisible or control character U+{ord(bad):04X} "
                                      f"({unicodedata.name(bad, 'unnamed')})"))
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


def _invisible(ch: str) -> bool:
    return unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp")


def _codes(col) -> tuple[np.ndarray, pa.Array]:
    """(a dense integer code per row, the distinct values): equal values, equal codes."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    enc = pc.dictionary_encode(arr)
    return np.asarray(enc.indices.to_numpy(zero_copy_only=False), dtype=np.int64), enc.dictionary


def _first_rows(codes: np.ndarray, n_codes: int) -> np.ndarray:
    """For each code, the first row (in file order) that has it."""
    first = np.full(n_codes, len(codes), dtype=np.int64)
    uniq, idx = np.unique(codes, return_index=True)
    first[uniq] = idx
    return first


def _first(mask: np.ndarray) -> int | None:
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def _in_buffer(values: pa.Array, existing: ExistingLookup, which: int) -> np.ndarray:
    """Rows whose value (distinct `values` asked LOOKUP_CHUNK at a time) the buffer already holds;
    `which`: 0 for rollout ids, 1 for group ids."""
    found: set[str] = set()
    for start in range(0, len(values), LOOKUP_CHUNK):
        chunk = values.slice(start, LOOKUP_CHUNK).to_pylist()
        found |= existing(chunk, [])[0] if which == 0 else existing([], chunk)[1]
    return np.array([v in found for v in values.to_pylist()], dtype=bool) if found else np.zeros(len(values), bool)


def _check_unique(table: pa.Table, file: str, existing: ExistingLookup | None) -> None:
    """rollout_id and (group_id, sample_idx) unique in the append and the buffer; groups are new.

    Reports the first row (in file order) that breaks any of them; for one row, in that order.
    Vectorised (integer codes per value): memory stays a few arrays of integers per row."""
    n = table.num_rows
    rows = np.arange(n, dtype=np.int64)
    rcode, rvalues = _codes(table.column("rollout_id"))
    gcode, gvalues = _codes(table.column("group_id"))
    idx = np.asarray(table.column("sample_idx").to_numpy(), dtype=np.int64)  # ≥ 0 (checked above)
    dup_rid = _first_rows(rcode, len(rvalues))[rcode] != rows
    old_rid = _in_buffer(rvalues, existing, 0)[rcode] if existing is not None else np.zeros(n, bool)
    pair = gcode * (int(idx.max()) + 1) + idx
    _, pair_code = np.unique(pair, return_inverse=True)
    dup_pair = _first_rows(pair_code, int(pair_code.max()) + 1)[pair_code] != rows
    old_gid = _in_buffer(gvalues, existing, 1)[gcode] if existing is not None else np.zeros(n, bool)
    row = _first(dup_rid | old_rid | dup_pair | old_gid)
    if row is None:
        return
    rid, gid = rvalues[rcode[row]].as_py(), gvalues[gcode[row]].as_py()
    if dup_rid[row]:
        raise ValidationError(file, rid, "rollout_id", "duplicate rollout_id in this append")
    if old_rid[row]:
        raise ValidationError(file, rid, "rollout_id", "rollout_id already in the buffer")
    if dup_pair[row]:
        raise ValidationError(file, rid, "sample_idx", f"(group_id, sample_idx) = ({gid!r}, {int(idx[row])}) repeated")
    raise ValidationError(file, rid, "group_id",
                          f"group {gid!r} is already in the buffer (a group's rows arrive in one append)")


def _check_agreement(table: pa.Table, file: str) -> None:
    """Every row of a group agrees with the group's first row on these columns; the first row in
    file order that does not is reported (ties: column order)."""
    cols = ("prompt_id", "prompt", "run_id", "step", "policy_version")
    gcode, gvalues = _codes(table.column("group_id"))
    head = _first_rows(gcode, len(gvalues))[gcode]  # each row's group's first row
    best: tuple[int, str] | None = None
    for c in cols:
        codes, _ = _codes(table.column(c))
        row = _first(codes != codes[head])
        if row is not None and (best is None or row < best[0]):
            best = (row, c)
    if best is None:
        return
    row, c = best
    j = int(head[row])
    mine, theirs = table.column(c)[row].as_py(), table.column(c)[j].as_py()
    raise ValidationError(
        file, table.column("rollout_id")[row].as_py(), c,
        f"group {gvalues[gcode[row]].as_py()!r} disagrees on {c}: {mine!r:.60} vs {theirs!r:.60}",
    )
