"""Evaluation arithmetic (docs/curation.md §Evaluation): the unbiased pass@k estimator and avg@n.

Invariants: pass@k from n ≥ k samples with c correct is 1 − C(n−c, k)/C(n, k) (1 when n − c < k),
computed as a product so it never overflows; unjudged samples count as incorrect.
"""

from __future__ import annotations

from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n:
        raise ValueError(f"need 0 ≤ c ≤ n, got n={n}, c={c}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):  # C(n−c, k)/C(n, k) = Π_{i=n−c+1}^{n} (1 − k/i)
        miss *= 1.0 - k / i
    return 1.0 - miss


def summarize(correct: Sequence[Sequence[bool | None]], ks: Sequence[int]) -> dict[str, float]:
    """pass@k for each k and avg@n, averaged over problems; `correct[p]` holds problem p's samples."""
    if not correct:
        raise ValueError("no problems to evaluate")
    out: dict[str, float] = {}
    n = min(len(c) for c in correct)
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(len(c), sum(bool(x) for x in c), k) for c in correct) / len(correct)
    out[f"avg@{n}"] = sum(sum(bool(x) for x in c) / len(c) for c in correct) / len(correct)
    return out
