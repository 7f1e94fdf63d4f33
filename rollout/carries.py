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

import random

from .addition import OPERANDS, AdditionTask  # noqa: F401  (OPERANDS: the operands, for callers)

SOURCE = "builtin:carries"
HELDOUT_PERCENT = 20
MAX_NEW_TOKENS = 8  # sampling budget of a response: the answer is a few digits
TEACHER_SLIP = 0.5  # how often the warm-start teacher forgets each carry, independently

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


TASK = AdditionTask("carries", SOURCE, LEVELS, SPLITS, level_of, HELDOUT_PERCENT)
is_heldout, make_prompt = TASK.is_heldout, TASK.make_prompt
train_prompts, heldout_prompts = TASK.train_prompts, TASK.heldout_prompts


def warmup_examples(n: int, seed: int = 0, split: str = "train", levels: tuple[int, ...] | None = None,
                    slip: float = TEACHER_SLIP) -> list[tuple[str, str]]:
    """n (prompt, answer) demonstrations of the weak teacher from the training partition (repeats allowed).

    Each carry of each example is forgotten with probability `slip` (seeded), independently.
    """
    lv = TASK.levels_of(split, levels)
    rng = random.Random(f"carries:teacher:{lv}:{seed}:{slip}")
    out = []
    for a, b, text in TASK.warmup_operands(n, seed, lv):
        out.append((text, str(slipped_sum(a, b, [rng.random() < slip for _ in range(3)]))))
    return out


def teacher_accuracy(level: int, slip: float = TEACHER_SLIP) -> float:
    """How often the weak teacher is right on a prompt of `level`."""
    return (1 - slip) ** level


def final_answer(text: str) -> str:
    """The result a response states: the whole response, stripped."""
    return text.strip()
