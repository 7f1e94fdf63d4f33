"""Split a logged full token sequence (prompt + response) into the rollouts' token columns.

Invariants:
- The response is the span from the first position whose loss mask is true to the last; every
  per-token list is cut to exactly that span, so all have the length of `response_token_ids`.
- A loss mask with a gap inside the response (a multi-turn row whose environment tokens are
  masked out) is refused naming the format, the file, the line and the field: a rollouts row
  holds one prompt and one sampled response.
- A row with no true position in its loss mask has no response and is refused likewise.
"""

from __future__ import annotations

from .common import bad


def response_span(mask: list, path: str, where: str, fmt: str, column: str) -> tuple[int, int]:
    on = [i for i, m in enumerate(mask) if m]
    if not on:
        raise bad(fmt, path, where, column, "no position is trained (no response)")
    start, end = on[0], on[-1] + 1
    if len(on) != end - start:
        raise bad(fmt, path, where, column, "the loss mask has a gap inside the response "
                  "(multi-turn rows are not supported)")
    return start, end
