"""The harder built-in task `builtin:carries`: three-digit additions, one level per carry.

A prompt is `a+b=` with three-digit operands (`"158+267="`); the answer is the sum (`"425"`),
followed by the policy's end-of-sequence token. A prompt's level is the number of carries its sum
makes, 0–3, so the levels spread from easy to hard:

| level | carries | example | weak teacher right |
|---|---|---|---|
| 0 | none | `123+456=579` | always |
| 1 | one | `158+221=379` | 1 − s |
| 2 | two | `158+267=425` | (1 − s)² |
| 3 | three (into the thousands) | `758+267=1025` | (1 − s)³ |

The warm start learns from a weak teacher that forgets **each** carry on its own with probability
`TEACHER_SLIP` = s (`158+267` → `415` when it forgets the first one): a policy that imitates it is
right on every level-0 prompt and ever more rarely as carries add up, so a batch holds all-correct
groups, informative ones and nearly all-wrong ones at once — the spread that prompt selection,
filtering and amplification act on. Unlike `builtin:arith`, it needs its own policy,
`builtin:tiny-carries` (same architecture and tokenizer, warm-started on this teacher).

Invariants:
- Deterministic: the same (n, seed, split) gives the same prompts in the same order on every
  machine and Python version (string-seeded `random.Random`, sha256 partitioning).
- The held-out partition is fixed by the prompt text alone (`is_heldout`, about `HELDOUT_PERCENT` %
  of all expressions): no training prompt or warm-up example is ever held out, whatever the seeds;
  `heldout_prompts(n)` is a prefix of `heldout_prompts(m)` for n < m, and its prompts are distinct.
- Every prompt carries its level as `difficulty`, `source == "builtin:carries"`, `prompt_id` =
  `prompt_hash` of the text, and the true sum as `gold_answer` (never the teacher's).
- Levels are interleaved round-robin, so any prefix of a list has a balanced mix of levels.
"""

from __future__ import annotations

import hashlib
import random
from typing import Iterator

from .prompts import Prompt, prompt_hash, task_levels

SOURCE = "builtin:carries"
HELDOUT_PERCENT = 20
MAX_NEW_TOKENS = 8  # sampling budget of a response: the answer is a few digits
TEACHER_SLIP = 0.5  # how often the warm-start teacher forgets each carry, independently
OPERANDS = range(100, 1000)
_MAX_TRIES = 1000  # draws spent looking for an unseen training expression before accepting a repeat

LEVELS: dict[int, str] = {
    0: "no carry",
    1: "one carry",
    2: "two carries",
    3: "three carries (into the thousands)",
}
MAX_LEVEL = max(LEVELS)
SPLITS: dict[str, tuple[int, ...]] = {"train": (0, 1, 2, 3)}


def carries(a: int, b: int) -> list[bool]:
    """Whether adding a and b carries out of the units, the tens and the hundreds."""
    out, carry = [], 0
    for _ in range(3):
        carry = int(a % 10 + b % 10 + carry >= 10)
        out.append(bool(carry))
        a, b = a // 10, b // 10
    return out


def level_of(a: int, b: int) -> int:
    """The number of carries of `a+b`."""
    return sum(carries(a, b))


def slipped_sum(a: int, b: int, forget: list[bool]) -> int:
    """`a+b` written digit by digit, dropping the carry out of position i where `forget[i]`."""
    total, carry, scale = 0, 0, 1
    for i in range(3):
        s = a % 10 + b % 10 + carry
        total += s % 10 * scale
        carry = 0 if forget[i] else s // 10
        a, b, scale = a // 10, b // 10, scale * 10
    return total + carry * scale


def is_heldout(prompt_text: str) -> bool:
    """Whether a prompt text belongs to the fixed held-out partition (~HELDOUT_PERCENT % of expressions)."""
    digest = hashlib.sha256(b"rollstore-carries-heldout:" + prompt_text.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def make_prompt(text: str) -> Prompt:
    """A `Prompt` for an expression `a+b=`, with its level and (true) gold answer."""
    a, b = (int(x) for x in text.rstrip("=").split("+"))
    return Prompt(prompt_id=prompt_hash(text), prompt=text, gold_answer=str(a + b), source=SOURCE,
                  difficulty=level_of(a, b))


def _draw(rng: random.Random, level: int, heldout: bool) -> tuple[int, int, str]:
    """One expression of `level` in the chosen partition, by rejection from uniform operand pairs."""
    while True:
        a, b = rng.choice(OPERANDS), rng.choice(OPERANDS)
        if level_of(a, b) == level:
            text = f"{a}+{b}="
            if is_heldout(text) == heldout:
                return a, b, text


def _levels_of(split: str, levels: tuple[int, ...] | None) -> tuple[int, ...]:
    return task_levels(SOURCE, LEVELS, SPLITS, split, levels)


def _round_robin(stream: str, levels: tuple[int, ...], heldout: bool, unique: bool) -> Iterator[tuple[int, int, str]]:
    """Expressions of the levels in turn, each level from its own seeded stream."""
    rngs = {lv: random.Random(f"{stream}:{lv}") for lv in levels}
    seen: set[str] = set()
    i = 0
    while True:
        level = levels[i % len(levels)]
        a, b, text = _draw(rngs[level], level, heldout)
        for _ in range(_MAX_TRIES if unique else 0):
            if text not in seen:
                break
            a, b, text = _draw(rngs[level], level, heldout)
        seen.add(text)
        yield a, b, text
        i += 1


def _take(it: Iterator[tuple[int, int, str]], n: int) -> list[tuple[int, int, str]]:
    return [next(it) for _ in range(n)]


def train_prompts(n: int, seed: int = 0, split: str = "train", levels: tuple[int, ...] | None = None) -> list[Prompt]:
    """n training prompts (never held-out ones), deterministic by seed, distinct while possible."""
    lv = _levels_of(split, levels)
    return [make_prompt(t) for _, _, t in _take(_round_robin(f"carries:train:{lv}:{seed}", lv, False, True), n)]


def heldout_prompts(n: int, split: str = "train", levels: tuple[int, ...] | None = None) -> list[Prompt]:
    """The first n prompts of the fixed held-out list (same on every call), all distinct."""
    lv = _levels_of(split, levels)
    return [make_prompt(t) for _, _, t in _take(_round_robin(f"carries:heldout:{lv}", lv, True, True), n)]


def warmup_examples(n: int, seed: int = 0, split: str = "train", levels: tuple[int, ...] | None = None,
                    slip: float = TEACHER_SLIP) -> list[tuple[str, str]]:
    """n (prompt, answer) demonstrations of the weak teacher from the training partition (repeats allowed).

    Each carry of each example is forgotten with probability `slip` (seeded), independently.
    """
    lv = _levels_of(split, levels)
    rng = random.Random(f"carries:teacher:{lv}:{seed}:{slip}")
    out = []
    for a, b, text in _take(_round_robin(f"carries:warmup:{lv}:{seed}", lv, False, False), n):
        out.append((text, str(slipped_sum(a, b, [rng.random() < slip for _ in range(3)]))))
    return out


def teacher_accuracy(level: int, slip: float = TEACHER_SLIP) -> float:
    """How often the weak teacher is right on a prompt of `level`."""
    return (1 - slip) ** level


def final_answer(text: str) -> str:
    """The result a response states: the whole response, stripped."""
    return text.strip()
