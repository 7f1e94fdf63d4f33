"""pass@k against its definition by enumeration, and avg@n."""

from __future__ import annotations

import itertools
from math import comb

import pytest
from hypothesis import given, strategies as st

from rollstore.learner.passk import pass_at_k, summarize


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_probability_a_k_subset_has_a_correct_sample(args):
    n, c, k = args
    samples = [True] * c + [False] * (n - c)
    hits = [any(sub) for sub in itertools.combinations(samples, k)]
    assert pass_at_k(n, c, k) == pytest.approx(sum(hits) / comb(n, k), abs=1e-12)


def test_edges_and_summary():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 8, 8) == 1.0 and pass_at_k(8, 1, 8) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 8)
    s = summarize([[True, False, False, False], [False] * 4, [True, None, True, False]], [1, 4])
    assert s["pass@1"] == pytest.approx((0.25 + 0 + 0.5) / 3)
    assert s["pass@4"] == pytest.approx(2 / 3)
    assert s["avg@4"] == pytest.approx(s["pass@1"])
