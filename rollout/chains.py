"""The reasoning built-in task `builtin:chains`: column addition written out, column by column.

A prompt is `a+b=` with three-digit operands (`"158+267="`). The answer is the working, one column
at a time from the units, each column stating the carry it takes in, then the result after ` = `:

    158+267=8+7+0=15 5+6+1=12 1+2+1=4 = 425

so a response is 29–33 tokens (with the end-of-sequence token). Almost all of them are determined
by what came before — each operand digit is copied from the prompt, each column's sum follows from
the three digits before it, the result is the columns' last digits read backwards — and a few are
**decisions**: the carry digit a column takes in (the `1` of `5+6+1`), which depends on whether the
previous column's sum had two digits. That is the shape of a chain of thought as the 80/20 study
saw it (arXiv 2506.01939): most tokens near-deterministic, a minority of "forking" tokens carrying
the entropy.

The warm start imitates a **weak teacher** that forgets a carry (writes `+0`) with a probability
set by the sum that made it — small sums are the hard ones:

| sum that carries | teacher forgets the carry |
|---|---|
| 10–12 | `SLIP_HARD` = 0.9 |
| 13–15 | `SLIP_MEDIUM` = 0.4 |
| 16–19 | `SLIP_EASY` = 0.1 |

A forgotten carry flows on, correctly computed, into a wrong result. Only the carries out of the
units and the tens are decisions (the carry out of the hundreds is the result's leading `1`, read
off the last column's sum). So a prompt's difficulty is a property of the prompt, not of luck —
which GRESO's premise (a prompt that was all-correct or all-wrong stays so) needs — and its level
says how many hard decisions it holds:

| level | the prompt's carry decisions | teacher right |
|---|---|---|
| 0 | none | always |
| 1 | medium or easy ones only (one or two) | 0.36–0.9 |
| 2 | one hard one (and maybe another) | 0.06–0.1 |
| 3 | two hard ones | 0.01 |

Invariants:
- Deterministic: the same (n, seed, split) gives the same prompts in the same order on every
  machine and Python version (string-seeded `random.Random`, sha256 partitioning).
- The held-out partition is fixed by the prompt text alone (`is_heldout`, about `HELDOUT_PERCENT` %
  of all expressions): no training prompt or warm-up example is ever held out, whatever the seeds;
  `heldout_prompts(n)` is a prefix of `heldout_prompts(m)` for n < m, and its prompts are distinct.
- Every prompt carries its level as `difficulty`, `source == "builtin:chains"`, `prompt_id` =
  `prompt_hash` of the text, and the true sum as `gold_answer` (never the teacher's); math-verify
  reads the result after the last ` = ` of a response (`final_answer` is the same rule, for the
  warm start's checks).
- `working(a, b)` with no forgotten carry is the one correct response; `working(a, b, forget)`
  computes every column exactly from the carries it wrote, so a slip changes only what follows it.
- Levels are interleaved round-robin, so any prefix of a list has a balanced mix of levels.
"""

from __future__ import annotations

import random

from .addition import OPERANDS, AdditionTask  # noqa: F401  (OPERANDS: the operands, for callers)

SOURCE = "builtin:chains"
HELDOUT_PERCENT = 20
SLIP_HARD, SLIP_MEDIUM, SLIP_EASY = 0.9, 0.4, 0.1
TEACHER_SLIP = {"hard (10-12)": SLIP_HARD, "medium (13-15)": SLIP_MEDIUM, "easy (16-19)": SLIP_EASY}
MAX_NEW_TOKENS = 40  # the longest response is 33 tokens with its end-of-sequence token

LEVELS: dict[int, str] = {
    0: "no carry decision",
    1: "medium or easy carries only",
    2: "one hard carry",
    3: "two hard carries",
}
MAX_LEVEL = max(LEVELS)
SPLITS: dict[str, tuple[int, ...]] = {"train": (0, 1, 2, 3)}


def slip_of(column_sum: int) -> float:
    """How often the teacher forgets the carry out of a column that summed to `column_sum` (>= 10)."""
    if column_sum <= 12:
        return SLIP_HARD
    if column_sum <= 15:
        return SLIP_MEDIUM
    return SLIP_EASY


def decisions(a: int, b: int) -> list[int]:
    """The sums of the columns whose carry is a decision (out of the units and the tens), when they carry."""
    out, carry = [], 0
    for _ in range(2):
        s = a % 10 + b % 10 + carry
        if s >= 10:
            out.append(s)
        carry = int(s >= 10)
        a, b = a // 10, b // 10
    return out


def level_of(a: int, b: int) -> int:
    """0: no decision; 1: no hard one; 2: one hard; 3: two hard (module table)."""
    sums = decisions(a, b)
    hard = sum(s <= 12 for s in sums)
    return 0 if not sums else 1 + hard


def working(a: int, b: int, forget: tuple[bool, bool] = (False, False)) -> str:
    """The response for `a+b=`: each column with its carry in, then ` = ` and the result.

    `forget[i]` drops the carry out of column i (units, tens); every sum is computed exactly from
    the carry written, so the result is what those written carries give.
    """
    cols, digits, carry = [], [], 0
    for i in range(3):
        x, y = a % 10, b % 10
        s = x + y + carry
        cols.append(f"{x}+{y}+{carry}={s}")
        digits.append(s % 10)
        carry = 0 if (i < 2 and forget[i]) else s // 10
        a, b = a // 10, b // 10
    result = "".join(str(d) for d in reversed(digits))
    if carry:
        result = "1" + result
    return " ".join(cols) + " = " + str(int(result))


def final_answer(text: str) -> str:
    """The result a response states: what follows its last ` = ` (math-verify reads the same)."""
    return text.rsplit("=", 1)[-1].strip()


def teacher_accuracy_of(a: int, b: int) -> float:
    """How often the weak teacher is right on `a+b=`."""
    p = 1.0
    for s in decisions(a, b):
        p *= 1 - slip_of(s)
    return p


TASK = AdditionTask("chains", SOURCE, LEVELS, SPLITS, level_of, HELDOUT_PERCENT)
is_heldout, make_prompt = TASK.is_heldout, TASK.make_prompt
train_prompts, heldout_prompts = TASK.train_prompts, TASK.heldout_prompts


def warmup_examples(n: int, seed: int = 0, split: str = "train", levels: tuple[int, ...] | None = None) -> list[tuple[str, str]]:
    """n (prompt, response) demonstrations of the weak teacher from the training partition (repeats allowed).

    Each carry decision of each example is forgotten with its sum's probability (`slip_of`), seeded.
    """
    lv = TASK.levels_of(split, levels)
    rng = random.Random(f"chains:teacher:{lv}:{seed}")
    out = []
    for a, b, text in TASK.warmup_operands(n, seed, lv):
        forget, carry, x, y = [], 0, a, b
        for _ in range(2):
            s = x % 10 + y % 10 + carry
            slipped = s >= 10 and rng.random() < slip_of(s)
            forget.append(slipped)
            carry = 0 if slipped else s // 10
            x, y = x // 10, y // 10
        out.append((text, working(a, b, (forget[0], forget[1]))))
    return out


def teacher_accuracy(level: int) -> float:
    """The weak teacher's mean accuracy over every expression of `level` (exact, by enumeration).

    The decisions depend on the operands' last two digits alone, which are uniform and independent of
    the hundreds, so enumerating those 100 × 100 pairs weighs every expression equally.
    """
    accs = [teacher_accuracy_of(a, b) for a in range(100) for b in range(100) if level_of(a, b) == level]
    return sum(accs) / len(accs)
