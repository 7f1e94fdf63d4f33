"""The prompt machinery the three-digit built-in tasks share (`builtin:carries`, `builtin:chains`).

A task is `a+b=` with three-digit operands, levelled by the task's own `level_of(a, b)`. This module
draws its prompts: a fixed held-out partition by a salted hash of the prompt text, levels
interleaved round-robin, each level from its own string-seeded stream.

Invariants:
- Deterministic: the same (n, seed, split) gives the same prompts in the same order on every
  machine and Python version (string-seeded `random.Random`, sha256 partitioning); the stream
  names are `<name>:<kind>:<levels>[:<seed>]`, so a task's prompts do not depend on any other task.
- The held-out partition is fixed by the prompt text alone (about `heldout_percent` % of all
  expressions): no training prompt or warm-up example is ever held out, whatever the seeds;
  `heldout_prompts(n)` is a prefix of `heldout_prompts(m)` for n < m, and its prompts are distinct.
- Every prompt carries its level as `difficulty`, the task's `source`, `prompt_id` = `prompt_hash`
  of the text, and the true sum as `gold_answer`.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable, Iterator

from .prompt_sources import Prompt, prompt_hash, task_levels

OPERANDS = range(100, 1000)
_MAX_TRIES = 1000  # draws spent looking for an unseen training expression before accepting a repeat


@dataclass(frozen=True)
class AdditionTask:
    """The prompts of one three-digit addition task (module invariants)."""

    name: str  # stream and salt prefix: "carries", "chains"
    source: str
    levels: dict[int, str]
    splits: dict[str, tuple[int, ...]]
    level_of: Callable[[int, int], int]
    heldout_percent: int = 20

    def is_heldout(self, prompt_text: str) -> bool:
        """Whether a prompt text belongs to the fixed held-out partition."""
        digest = hashlib.sha256(f"rollstore-{self.name}-heldout:".encode() + prompt_text.encode()).digest()
        return int.from_bytes(digest[:4], "big") % 100 < self.heldout_percent

    def make_prompt(self, text: str) -> Prompt:
        """A `Prompt` for an expression `a+b=`, with its level and (true) gold answer."""
        a, b = (int(x) for x in text.rstrip("=").split("+"))
        return Prompt(prompt_id=prompt_hash(text), prompt=text, gold_answer=str(a + b), source=self.source,
                      difficulty=self.level_of(a, b))

    def _draw(self, rng: random.Random, level: int, heldout: bool) -> tuple[int, int, str]:
        """One expression of `level` in the chosen partition, by rejection from uniform operand pairs."""
        while True:
            a, b = rng.choice(OPERANDS), rng.choice(OPERANDS)
            if self.level_of(a, b) == level:
                text = f"{a}+{b}="
                if self.is_heldout(text) == heldout:
                    return a, b, text

    def levels_of(self, split: str, levels: tuple[int, ...] | None) -> tuple[int, ...]:
        return task_levels(self.source, self.levels, self.splits, split, levels)

    def stream(self, stream: str, levels: tuple[int, ...], heldout: bool, unique: bool) -> Iterator[tuple[int, int, str]]:
        """Expressions of the levels in turn, each level from its own seeded stream."""
        rngs = {lv: random.Random(f"{stream}:{lv}") for lv in levels}
        seen: set[str] = set()
        i = 0
        while True:
            level = levels[i % len(levels)]
            a, b, text = self._draw(rngs[level], level, heldout)
            for _ in range(_MAX_TRIES if unique else 0):
                if text not in seen:
                    break
                a, b, text = self._draw(rngs[level], level, heldout)
            seen.add(text)
            yield a, b, text
            i += 1

    def train_prompts(self, n: int, seed: int = 0, split: str = "train",
                      levels: tuple[int, ...] | None = None) -> list[Prompt]:
        """n training prompts (never held-out ones), deterministic by seed, distinct while possible."""
        lv = self.levels_of(split, levels)
        return [self.make_prompt(t) for _, _, t in take(self.stream(f"{self.name}:train:{lv}:{seed}", lv, False, True), n)]

    def heldout_prompts(self, n: int, split: str = "train", levels: tuple[int, ...] | None = None) -> list[Prompt]:
        """The first n prompts of the fixed held-out list (same on every call), all distinct."""
        lv = self.levels_of(split, levels)
        return [self.make_prompt(t) for _, _, t in take(self.stream(f"{self.name}:heldout:{lv}", lv, True, True), n)]

    def warmup_operands(self, n: int, seed: int, lv: tuple[int, ...]) -> list[tuple[int, int, str]]:
        """n training expressions for the warm start's demonstrations (repeats allowed)."""
        return take(self.stream(f"{self.name}:warmup:{lv}:{seed}", lv, False, False), n)


def take(it: Iterator[tuple[int, int, str]], n: int) -> list[tuple[int, int, str]]:
    return [next(it) for _ in range(n)]
