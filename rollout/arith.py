"""The built-in task `builtin:arith`: two-digit additions that carry, for a character-level tiny policy.

A prompt is `a+b=` with two-digit operands (`"58+67="`); the answer is the sum (`"125"`), which
the policy should emit followed by its end-of-sequence token. Every prompt carries at least once:
its level says where.

| level | carries | example | expressions |
|---|---|---|---|
| 1 | into the tens only | `15+17=32` | 1 260 |
| 2 | out of the tens only | `52+61=113` | 2 475 |
| 3 | into and out of the tens | `58+67=125` | 2 385 |

The warm start learns from a weak teacher (`warmup_examples`): with probability `TEACHER_SLIP`
the teacher forgets every carry and writes the digit-wise sum (`58+67=15`). A policy that imitates
it answers right about 1 − TEACHER_SLIP of the time when sampling and mostly wrong when greedy,
on every level, which is the room a verifier-driven RL has to fix a systematic error.

Invariants:
- Everything is deterministic: the same (n, seed, split) gives the same prompts in the same order,
  on every machine and Python version (string-seeded `random.Random`, sha256 partitioning).
- The held-out partition is fixed by the prompt text alone (`is_heldout`, about `HELDOUT_PERCENT`
  % of all expressions), so no training prompt or warm-up example is ever a held-out prompt,
  whatever the seeds; `heldout_prompts(n)` is a prefix of `heldout_prompts(m)` for n < m.
- Held-out prompts are distinct (about 1 200 in all, 250–500 per level), so no expression weighs
  more than another in an accuracy; a level whose held-out expressions run out leaves the rotation.
- Every prompt carries its level (1 = easiest, `MAX_LEVEL` = hardest) as `difficulty` and
  `source == "builtin:arith"`; `prompt_id` is `prompt_hash` of the text; `gold_answer` is the
  true sum (never the teacher's).
- Levels are interleaved round-robin, so any prefix of a list has a balanced mix of its split.
"""

from __future__ import annotations

import functools
import hashlib
import random

from .prompt_sources import Prompt, prompt_hash, task_levels

SOURCE = "builtin:arith"
HELDOUT_SEED = "heldout-v2"  # fixed: the held-out list never depends on a caller's seed
HELDOUT_PERCENT = 20
MAX_NEW_TOKENS = 8  # sampling budget of a response: the answer is a few digits
TEACHER_SLIP = 0.7  # how often the warm-start teacher forgets every carry
OPERANDS = range(10, 100)
_MAX_TRIES = 200  # draws spent looking for an unseen expression before accepting a repeat

LEVELS: dict[int, str] = {
    1: "carry into the tens only",
    2: "carry out of the tens only",
    3: "carry into and out of the tens",
}
MAX_LEVEL = max(LEVELS)

# Named splits: which levels a split draws from (`harder`: both carries, for hard-prompt experiments).
SPLITS: dict[str, tuple[int, ...]] = {
    "train": (1, 2, 3),
    "harder": (3,),
}


def level_of(a: int, b: int) -> int:
    """The level of `a+b` (0: no carry, not part of the task)."""
    into_tens = a % 10 + b % 10 >= 10
    out_of_tens = a // 10 + b // 10 + into_tens >= 10
    return {(True, False): 1, (False, True): 2, (True, True): 3}.get((into_tens, out_of_tens), 0)


def evaluate(expr: str) -> int:
    """Integer value of an expression of non-negative integers joined by `+`, `-`, `*`."""
    total, term, sign, num = 0, 1, 1, ""
    for ch in expr + "+":
        if ch.isdigit():
            num += ch
            continue
        if not num:
            raise ValueError(f"malformed expression {expr!r}")
        term *= int(num)
        num = ""
        if ch == "*":
            continue
        if ch not in "+-":
            raise ValueError(f"malformed expression {expr!r}")
        total += sign * term
        term, sign = 1, (1 if ch == "+" else -1)
    return total


def carry_free_sum(a: int, b: int) -> int:
    """The sum written digit by digit with every carry forgotten (the teacher's slip): 58+67 → 15."""
    return (a // 10 + b // 10) % 10 * 10 + (a % 10 + b % 10) % 10


def is_heldout(prompt_text: str) -> bool:
    """Whether a prompt text belongs to the fixed held-out partition (~HELDOUT_PERCENT % of expressions)."""
    digest = hashlib.sha256(b"rollstore-arith-heldout:" + prompt_text.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


@functools.lru_cache(maxsize=None)
def _domain(level: int, heldout: bool) -> tuple[str, ...]:
    """Every expression of a level in one partition, in a fixed order."""
    out = (f"{a}+{b}=" for a in OPERANDS for b in OPERANDS if level_of(a, b) == level)
    return tuple(e for e in out if is_heldout(e) == heldout)


def _levels_of(split: str, levels: tuple[int, ...] | None) -> tuple[int, ...]:
    return task_levels(SOURCE, LEVELS, SPLITS, split, levels)


def _generate(n: int, stream: str, levels: tuple[int, ...], unique: bool = True) -> list[Prompt]:
    """n training-partition prompts, levels round-robin; with `unique`, no repeats until a level runs dry."""
    rng = random.Random(stream)
    seen: set[str] = set()
    exhausted: set[int] = set()  # levels where an unseen expression was not found: stop looking
    out: list[Prompt] = []
    for i in range(n):
        level = levels[i % len(levels)]
        domain = _domain(level, False)
        want_new = unique and level not in exhausted
        text = domain[rng.randrange(len(domain))]
        if want_new:
            for _ in range(_MAX_TRIES):
                if text not in seen:
                    break
                text = domain[rng.randrange(len(domain))]
            else:
                exhausted.add(level)
        seen.add(text)
        out.append(make_prompt(text, level))
    return out


def make_prompt(text: str, level: int | None = None) -> Prompt:
    """A `Prompt` for an expression text ending in `=`, with its (true) gold answer."""
    return Prompt(
        prompt_id=prompt_hash(text),
        prompt=text,
        gold_answer=str(evaluate(text.rstrip("="))),
        source=SOURCE,
        difficulty=level,
    )


def train_prompts(
    n: int, seed: int = 0, split: str = "train", levels: tuple[int, ...] | None = None
) -> list[Prompt]:
    """n training prompts (never held-out ones), deterministic by seed; unique while possible."""
    lv = _levels_of(split, levels)
    return _generate(n, f"arith:train:{split}:{lv}:{seed}", lv)


def heldout_prompts(
    n: int, split: str = "train", levels: tuple[int, ...] | None = None
) -> list[Prompt]:
    """The first n prompts of the fixed held-out list of a split (same on every call), all distinct.

    Fewer than n only when the split's whole held-out partition is smaller than n.
    """
    lv = _levels_of(split, levels)
    pools = {}
    for level in lv:
        pool = list(_domain(level, True))
        random.Random(f"arith:heldout:{HELDOUT_SEED}:{level}").shuffle(pool)
        pools[level] = pool[::-1]  # pop() from the end takes them in shuffled order
    out: list[Prompt] = []
    active = list(lv)
    i = 0
    while len(out) < n and active:
        level = active[i % len(active)]
        if not pools[level]:
            active.remove(level)  # the next level takes this turn; i stays
            continue
        out.append(make_prompt(pools[level].pop(), level))
        i += 1
    return out


def warmup_examples(
    n: int, seed: int = 0, split: str = "train", levels: tuple[int, ...] | None = None,
    slip: float = TEACHER_SLIP,
) -> list[tuple[str, str]]:
    """n (prompt, answer) demonstrations of the weak teacher from the training partition (repeats allowed).

    With probability `slip` (per example, seeded) the answer is the carry-free sum, else the true one.
    """
    lv = _levels_of(split, levels)
    prompts = _generate(n, f"arith:warmup:{split}:{lv}:{seed}", lv, unique=False)
    rng = random.Random(f"arith:teacher:{split}:{lv}:{seed}:{slip}")
    out = []
    for p in prompts:
        a, b = (int(x) for x in p.prompt.rstrip("=").split("+"))
        out.append((p.prompt, str(carry_free_sum(a, b)) if rng.random() < slip else p.gold_answer))
    return out


def final_answer(text: str) -> str:
    """The result a response states: the whole response, stripped."""
    return text.strip()
