"""The prompt record every task and dataset produces.

Invariants:
- `prompt` is the exact text handed to the model (after any chat template); `prompt_id` is stable
  across steps and runs: taken from the dataset when given, else `prompt_hash` of the raw prompt
  text (before any template), so re-templating a dataset keeps its prompt history.
- `gold_answer` is the reduced reference answer (e.g. `42`, not a GSM8K rationale), or None.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

PROMPT_ID_CHARS = 16  # hex characters of sha256 kept in a derived prompt_id


def prompt_hash(text: str) -> str:
    """Stable id for a prompt text: the first 16 hex characters of its UTF-8 sha256."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:PROMPT_ID_CHARS]


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    prompt: str
    gold_answer: str | None
    source: str
    difficulty: int | None = None
    meta: dict = field(default_factory=dict, compare=False, hash=False)


def task_levels(source: str, all_levels: dict, splits: dict, split: str, levels: tuple[int, ...] | None) -> tuple[int, ...]:
    """The levels a built-in task draws from: `levels` when given (each one of the task's), else the split's."""
    if levels is not None:
        if not levels or any(lv not in all_levels for lv in levels):
            raise ValueError(f"{source} has levels {sorted(all_levels)}, got {list(levels)}")
        return tuple(levels)
    if split not in splits:
        raise ValueError(f"{source} has splits {sorted(splits)}, got {split!r}")
    return splits[split]
