"""Split a logged full token sequence (prompt + response) into the rollouts' token columns.

Invariants:
- The response is the span from the first position whose loss mask is true to the last; every
  per-token list is cut to exactly that span, so all have the length of `response_token_ids`.
- A loss mask with a gap inside the response (a multi-turn row whose environment tokens are
  masked out) is refused naming the file, the row and the column: a rollouts row holds one
  prompt and one sampled response.
- A row with no true position in its loss mask has no response and is refused likewise.
"""

from __future__ import annotations

from ..errors import ValidationError


def response_span(mask: list, path: str, rid: str, fmt: str, column: str) -> tuple[int, int]:
    on = [i for i, m in enumerate(mask) if m]
    if not on:
        raise ValidationError(path, rid, column, f"{fmt}: no position is trained (no response)")
    start, end = on[0], on[-1] + 1
    if len(on) != end - start:
        raise ValidationError(path, rid, column, f"{fmt}: the loss mask has a gap inside the response "
                              "(multi-turn rows are not supported)")
    return start, end


def per_token(row: dict, name: str, n: int, path: str, rid: str, fmt: str) -> list:
    value = row.get(name)
    if not isinstance(value, list) or len(value) < n:
        got = "absent" if value is None else f"{len(value)} values" if isinstance(value, list) else type(value).__name__
        raise ValidationError(path, rid, name, f"{fmt}: expected a list of at least {n} values, got {got}")
    return value
