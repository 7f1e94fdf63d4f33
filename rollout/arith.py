"""The built-in task `builtin:arith`: integer arithmetic for a character-level tiny policy.

A prompt is an expression followed by `=` (`"12+7="`); the answer is the integer result as a string
(`"19"`, `"-5"`), which the policy should emit followed by its end-of-sequence token. Usual
precedence applies (`*` before `+`/`-`); no parentheses, no spaces.

Invariants:
- Everything is deterministic: the same (n, seed, split) gives the same prompts in the same order,
  on every machine and Python version (string-seeded `random.Random`, sha256 partitioning).
- The held-out partition is fixed by the prompt text alone (`is_heldout`, about 10 % of all
  expressions), so no training prompt or warm-up example is ever a held-out prompt, whatever the
  seeds; `heldout_prompts(n)` is a prefix of `heldout_prompts(m)` for n < m.
- Held-out prompts are distinct: a level whose held-out expressions run out (levels 1 and 3 have
  only a few dozen: their whole domain is a few hundred expressions) drops out of the rotation
  instead of repeating one, so no single expression weighs more than another in an accuracy.
- Every prompt carries its difficulty level (1 = easiest, `MAX_LEVEL` = hardest) and
  `source == "builtin:arith"`; `prompt_id` is `prompt_hash` of the text, like any file dataset.
- Levels are interleaved round-robin, so any prefix of a list has a balanced mix of its split.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass

from .prompts import Prompt, prompt_hash

SOURCE = "builtin:arith"
HELDOUT_SEED = "heldout-v1"  # fixed: the held-out list never depends on a caller's seed
HELDOUT_PERCENT = 10
_MAX_TRIES = 200  # draws spent looking for an unseen expression before accepting a repeat
_ENUMERATE_UP_TO = 5000  # levels with at most this many expressions are enumerated, not sampled


@dataclass(frozen=True)
class Level:
    """How expressions of one difficulty level are drawn."""

    level: int
    operands: tuple[int, ...]  # allowed operand counts
    digits: tuple[int, int]  # min and max digits of each operand
    ops: str  # allowed operators
    need_mul: bool = False  # at least one `*`


LEVELS: dict[int, Level] = {
    1: Level(1, (2,), (1, 1), "+-"),  # 7-3=
    2: Level(2, (2,), (2, 2), "+-"),  # 45+38=
    3: Level(3, (2,), (1, 1), "*"),  # 6*7=
    4: Level(4, (3,), (1, 1), "+-*", need_mul=True),  # 3+4*5= (precedence)
    5: Level(5, (2, 3), (2, 3), "+-"),  # 512-389=, 47+12-30=
}
MAX_LEVEL = max(LEVELS)

# Named splits: which levels a split draws from. `harder` holds the levels where a warm-started
# tiny policy gets few answers right (precedence and 3-digit carries), for experiments on hard prompts.
SPLITS: dict[str, tuple[int, ...]] = {
    "train": (1, 2, 3, 4, 5),
    "harder": (4, 5),
}


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


def is_heldout(prompt_text: str) -> bool:
    """Whether a prompt text belongs to the fixed held-out partition (~10 % of expressions)."""
    digest = hashlib.sha256(b"rollstore-arith-heldout:" + prompt_text.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def _operand(rng: random.Random, digits: int) -> int:
    if digits == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def _draw(rng: random.Random, spec: Level) -> str:
    n = rng.choice(spec.operands)
    nums = [_operand(rng, rng.randint(*spec.digits)) for _ in range(n)]
    ops = [rng.choice(spec.ops) for _ in range(n - 1)]
    if spec.need_mul and "*" not in ops:
        ops[rng.randrange(n - 1)] = "*"
    expr = str(nums[0]) + "".join(op + str(x) for op, x in zip(ops, nums[1:]))
    return expr + "="


def _domain(spec: Level) -> list[str] | None:
    """Every expression of a small level, in a fixed order; None when the level is large."""
    lo, hi = spec.digits
    values = [x for d in range(lo, hi + 1) for x in (range(10) if d == 1 else range(10 ** (d - 1), 10**d))]
    size = sum(len(values) ** n * len(spec.ops) ** (n - 1) for n in spec.operands)
    if size > _ENUMERATE_UP_TO:
        return None
    out = []
    for n in spec.operands:
        for nums in itertools.product(values, repeat=n):
            for ops in itertools.product(spec.ops, repeat=n - 1):
                if spec.need_mul and "*" not in ops:
                    continue
                out.append(str(nums[0]) + "".join(op + str(x) for op, x in zip(ops, nums[1:])) + "=")
    return out


def _distinct_heldout(n: int, stream: str, levels: tuple[int, ...]) -> list[Prompt]:
    """n distinct held-out prompts, levels round-robin; an exhausted level leaves the rotation."""
    rng = random.Random(stream)
    pools: dict[int, list[str]] = {}
    for lv in levels:
        domain = _domain(LEVELS[lv])
        if domain is not None:
            pool = [e for e in domain if is_heldout(e)]
            random.Random(f"{stream}:{lv}").shuffle(pool)
            pools[lv] = pool[::-1]  # pop() from the end takes them in shuffled order
    seen: set[str] = set()
    out: list[Prompt] = []
    active = list(levels)
    i = 0
    while len(out) < n and active:
        lv = active[i % len(active)]
        text = None
        if lv in pools:
            text = pools[lv].pop() if pools[lv] else None
        else:
            for _ in range(_MAX_TRIES):
                cand = _draw(rng, LEVELS[lv])
                if is_heldout(cand) and cand not in seen:
                    text = cand
                    break
        if text is None:
            active.remove(lv)  # the next level takes this turn; i stays
            continue
        seen.add(text)
        out.append(make_prompt(text, lv))
        i += 1
    return out


def _levels_of(split: str, levels: tuple[int, ...] | None) -> tuple[int, ...]:
    if levels is not None:
        bad = [lv for lv in levels if lv not in LEVELS]
        if bad or not levels:
            raise ValueError(f"builtin:arith has levels {sorted(LEVELS)}, got {list(levels)}")
        return tuple(levels)
    if split not in SPLITS:
        raise ValueError(f"builtin:arith has splits {sorted(SPLITS)}, got {split!r}")
    return SPLITS[split]


def _generate(
    n: int, stream: str, want_heldout: bool, levels: tuple[int, ...], unique: bool = True
) -> list[Prompt]:
    """n prompts, levels round-robin; with `unique`, no repeats until a level's partition runs dry."""
    rng = random.Random(stream)
    seen: set[str] = set()
    exhausted: set[int] = set()  # levels where an unseen expression was not found: stop looking
    out: list[Prompt] = []
    for i in range(n):
        spec = LEVELS[levels[i % len(levels)]]
        want_new = unique and spec.level not in exhausted
        text = None
        for _ in range(_MAX_TRIES):
            cand = _draw(rng, spec)
            if is_heldout(cand) != want_heldout:
                continue
            text = cand
            if not want_new or cand not in seen:
                break
        else:
            exhausted.add(spec.level)
        if text is None:  # pragma: no cover - every level has expressions in both partitions
            raise RuntimeError(f"no expression of level {spec.level} in the requested partition")
        seen.add(text)
        out.append(make_prompt(text, spec.level))
    return out


def make_prompt(text: str, level: int | None = None) -> Prompt:
    """A `Prompt` for an expression text ending in `=`, with its gold answer."""
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
    return _generate(n, f"arith:train:{split}:{lv}:{seed}", False, lv)


def heldout_prompts(
    n: int, split: str = "train", levels: tuple[int, ...] | None = None
) -> list[Prompt]:
    """The first n prompts of the fixed held-out list of a split (same on every call), all distinct.

    Fewer than n only when the split's whole held-out partition is smaller than n.
    """
    lv = _levels_of(split, levels)
    return _distinct_heldout(n, f"arith:heldout:{split}:{lv}:{HELDOUT_SEED}", lv)


def warmup_examples(
    n: int, seed: int = 0, split: str = "train", levels: tuple[int, ...] | None = None
) -> list[tuple[str, str]]:
    """n (prompt, answer) pairs for a supervised warm start from the training partition (repeats allowed)."""
    lv = _levels_of(split, levels)
    prompts = _generate(n, f"arith:warmup:{split}:{lv}:{seed}", False, lv, unique=False)
    return [(p.prompt, p.gold_answer) for p in prompts]
