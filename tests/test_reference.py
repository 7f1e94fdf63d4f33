"""Hand-computed checks of the brute-force reference (tests/reference.py) itself.

The reference is what the SQL curation engine is tested against, so it must first be shown to
agree with docs/curation.md on small cases worked out by hand.
"""

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    from tests.reference import (brute_force_max_variance, max_variance_subset,
                                 reference_curate)
except ImportError:  # tests/ run as a rootdir-less directory
    from reference import brute_force_max_variance, max_variance_subset, reference_curate


def row(rid, gid, reward, correct, *, prompt="P", version=5, n_tokens=4, entropies=None,
        verify_error=None, finish_reason="stop"):
    return {
        "rollout_id": rid, "group_id": gid, "prompt_id": prompt, "sample_idx": 0,
        "policy_version": version, "reward": reward, "correct": correct,
        "verify_error": verify_error, "finish_reason": finish_reason,
        "response_token_ids": list(range(n_tokens)),
        "entropies": entropies if entropies is not None else [1.0] * n_tokens,
        "gen_logprobs": [-0.5] * n_tokens, "old_logprobs": [-0.5] * n_tokens,
    }


def binary_group(gid, k, G, **kw):
    return [row(f"{gid}-{i}", gid, 1.0 if i < k else 0.0, i < k, **kw) for i in range(G)]


def test_binary_population_std_formula():
    # §1: binary rewards, population std: A+ = sqrt((1-p)/p), A- = -sqrt(p/(1-p)).
    rows = binary_group("g", 2, 8)                         # p = 1/4
    sel = reference_curate(rows, {"std": "population"})["selections"]
    p = 0.25
    a_pos, a_neg = sel["g-0"]["advantage_raw"], sel["g-7"]["advantage_raw"]
    assert isinstance(a_pos, np.float32)
    assert math.isclose(a_pos, math.sqrt((1 - p) / p), rel_tol=1e-5)
    assert math.isclose(a_neg, -math.sqrt(p / (1 - p)), rel_tol=1e-5)
    # exact value with eps: std = sqrt(p(1-p))
    assert a_pos == np.float32((1 - p) / (math.sqrt(p * (1 - p)) + 1e-6))


def test_equal_rewards_and_singletons_give_zero():
    rows = [row("a", "g1", 0.7, True), row("b", "g1", 0.7, False), row("c", "g2", 5.0, True)]
    sel = reference_curate(rows, {"std": "sample"})["selections"]
    assert [sel[r]["advantage_raw"] for r in "abc"] == [0.0, 0.0, 0.0]
    assert sel["c"]["group_size"] == 1


def test_three_of_five_max_variance():
    values = [0.0, 1.0, 2.0, 3.0, 10.0]
    items = [(v, f"r{i}") for i, v in enumerate(values)]
    chosen = max_variance_subset(items, 3)
    # by hand: j=1 -> {10} ∪ {1, 0}, Var = 101/3 - (11/3)^2 = 182/9
    assert chosen == ["r4", "r1", "r0"]
    var = float(np.var([values[int(r[1])] for r in chosen]))
    assert math.isclose(var, 182 / 9, rel_tol=1e-12)
    assert math.isclose(brute_force_max_variance(values, 3), 182 / 9, rel_tol=1e-12)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-6, 6).map(lambda x: x / 2), min_size=1, max_size=8),
       st.data())
def test_top_bottom_structure_reaches_enumeration(values, data):
    M = data.draw(st.integers(1, len(values)))
    items = [(v, f"r{i}") for i, v in enumerate(values)]
    chosen = max_variance_subset(items, M)
    assert len(chosen) == M == len(set(chosen))
    var = float(np.var([values[int(r[1:])] for r in chosen]))
    assert var >= brute_force_max_variance(values, M) * (1 - 1e-9) - 1e-12


def test_tie_rule_prefers_balanced_then_smaller_j():
    # values all equal: every S_j ties; M=2 -> j=1 (|2j-M| = 0): first and last in pool order
    items = [(1.0, "b"), (1.0, "a"), (1.0, "c")]
    assert max_variance_subset(items, 2) == ["a", "c"]
    # M=3 of 4 equal: j=1 and j=2 tie on |2j-M| = 1 -> smaller j = 1: first 1 ∪ last 2
    items = [(1.0, x) for x in "dcba"]
    assert max_variance_subset(items, 3) == ["a", "c", "d"]


def test_da3po_factor_by_hand():
    # batch: g1 (prompt P, 1 of 4 correct) and g2 (prompt Q, 2 of 4 correct); cv = 5, W = 4.
    g1 = binary_group("g1", 1, 4, prompt="P")
    g2 = binary_group("g2", 2, 4, prompt="Q")
    in_window = binary_group("h3", 0, 4, prompt="P", version=3)       # counts: 0 of 4
    below = binary_group("h1", 4, 4, prompt="P", version=1)           # outside [2, 5]
    unjudged = [row("hx", "hx", 1.0, None, prompt="P", version=4)]    # correct null: ignored
    snapshot = g1 + g2 + in_window + below + unjudged
    res = reference_curate(g1 + g2, {"amplify": "da3po"}, snapshot_rows=snapshot)
    sel = res["selections"]
    mu = 3 / 8
    q_p = (1 + 2 * mu) / (8 + 2)                                      # 0.175
    q_q = (2 + 2 * mu) / (4 + 2)
    w = 0.25 * (1 - q_p) / (q_p * (1 - 0.25))                         # 11/7
    assert math.isclose(w, 11 / 7, rel_tol=1e-12)
    assert sel["g1-0"]["difficulty"] == np.float32(q_p)
    assert sel["g1-3"]["difficulty"] == np.float32(q_p)
    assert sel["g2-0"]["difficulty"] == np.float32(q_q)
    a_raw = sel["g1-0"]["advantage_raw"]
    assert a_raw == np.float32(0.75 / (0.5 + 1e-6))                   # sample std = 0.5
    assert sel["g1-0"]["amplification"] == np.float32(11 / 7)
    assert sel["g1-0"]["advantage_final"] == np.float32(w * float(a_raw))
    # incorrect rows of g1 and every row of g2 (p = 0.5, not < τ) keep w = 1
    assert sel["g1-1"]["amplification"] == 1.0
    assert sel["g1-1"]["advantage_final"] == sel["g1-1"]["advantage_raw"]
    assert sel["g2-0"]["amplification"] == 1.0


def test_current_group_counts_below_window():
    # the batch group sits below the window (cv = 9 from the other group, W = 4)
    old = binary_group("old", 1, 4, prompt="P", version=2)
    new = binary_group("new", 2, 4, prompt="Q", version=9)
    sel = reference_curate(old + new, {"amplify": "da3po"})["selections"]
    mu = 3 / 8
    assert sel["old-0"]["difficulty"] == np.float32((1 + 2 * mu) / (4 + 2))


def test_group_amplification_and_dynamic_filter():
    rows = binary_group("g", 1, 4) + binary_group("z", 4, 4)
    sel = reference_curate(rows, {"amplify": "group", "filter": "dynamic"})["selections"]
    w = min(3.0, 1 / (2 * math.sqrt(0.25 * 0.75)))
    assert sel["g-0"]["amplification"] == np.float32(w)
    assert sel["g-0"]["difficulty"] is None
    z = sel["z-0"]
    assert z["reason"] == "zero_variance" and not z["selected"]
    assert z["group_size"] == 4 and z["group_accuracy"] == 1.0
    assert z["amplification"] == 1.0 and z["advantage_final"] == z["advantage_raw"] == 0.0
    assert z["sample_rank"] is None and z["tokens_kept"] == 0


def test_eligibility_order_and_nulls():
    rows = [
        row("inv", "g", 1.0, None, finish_reason="length", version=0),
        row("tr", "g", 1.0, True, finish_reason="length", version=0),
        row("st", "g", 1.0, True, version=0),
        row("ru", "g", 1.0, True),
        row("ok1", "g", 1.0, True),
        row("ok2", "g", 0.0, False),
    ]
    res = reference_curate(rows, {"truncated": "drop", "max_policy_lag": 2, "max_reuse": 1},
                           prior_selected_counts={"ru": 1, "ok1": 0})
    sel = res["selections"]
    assert [sel[r]["reason"] for r in ("inv", "tr", "st", "ru")] == \
        ["invalid", "truncated", "stale", "reused"]
    for r in ("inv", "tr", "st", "ru"):
        s = sel[r]
        assert all(s[f] is None for f in ("group_size", "group_accuracy", "difficulty",
                                           "advantage_raw", "amplification",
                                           "advantage_final", "sample_rank"))
        assert s["tokens_kept"] == 0 and s["tokens_total"] == 4
    assert sel["ok1"]["group_size"] == 2 and sel["ok1"]["group_accuracy"] == 0.5
    assert res["record"]["n_candidates"] == 6 and res["record"]["n_selected"] == 2
    assert res["record"]["tokens_candidate"] == 24


def test_empty_batch_and_empty_pool():
    with pytest.raises(ValueError, match="empty batch"):
        reference_curate([], {})
    rows = binary_group("z", 0, 3)
    rec = reference_curate(rows, {"filter": "dynamic", "sample": "cross_group",
                                  "token": "abs_adv_entropy"})["record"]
    assert rec["n_selected"] == 0 and rec["sample_budget"] == 0
    assert rec["adv_var_before"] is None and rec["adv_var_after"] is None
    assert rec["token_threshold"] is None and rec["token_fraction"] == Fraction(1, 5)


def test_token_k_is_exact_ceil():
    # 0.07 * 100 == 7.000000000000001 in binary floating point; K must be exactly 7
    assert math.ceil(0.07 * 100) == 8
    ents = [float(i) for i in range(50)]
    rows = [row("a", "g", 1.0, True, n_tokens=50, entropies=ents),
            row("b", "g", 0.0, False, n_tokens=50, entropies=ents)]
    res = reference_curate(rows, {"token": "entropy", "token_fraction": "0.07"})
    assert res["record"]["tokens_kept"] == 7
    # top 7 by entropy: 49,49,48,48,47,47,46 -> ties by rollout_id: a keeps 49..46, b 49..47
    assert res["masks"]["a"].count(True) == 4 and res["masks"]["b"].count(True) == 3
    assert res["record"]["token_threshold"] == 46.0


def test_linear_budget_is_exact_half_up():
    # f = 0.25 + 0.75 * 0.7 = 0.775 exactly; N = 20 -> 15.5 -> 16 (floats give 15)
    assert math.floor(20 * (0.25 + 0.75 * 0.7) + 0.5) == 15
    rows = [row(f"r{i:02d}", f"g{i // 4}", float(i % 4), i % 4 == 3) for i in range(20)]
    res = reference_curate(rows, {"sample": "cross_group", "schedule": "linear",
                                  "progress": "0.7"})
    assert res["record"]["sample_budget"] == 16 == res["record"]["n_selected"]
    ranks = sorted(s["sample_rank"] for s in res["selections"].values() if s["selected"])
    assert ranks == list(range(1, 17))


def test_missing_entropies_names_rollout():
    rows = [row("a", "g", 1.0, True), row("b", "g", 0.0, False)]
    rows[1]["entropies"] = None
    with pytest.raises(ValueError, match="rollout b"):
        reference_curate(rows, {"token": "abs_adv_entropy"})


def test_pods_select_renormalise_amplify():
    # 1 of 6 correct, f = 0.5 -> m = 3; pool order a(1), b..f(0). S_1 = {a, e, f}, S_2 and S_3
    # tie on Var = 2/9; smallest |2j - 3| -> j in {1, 2} -> smaller j = 1.
    rows = [row(x, "g", 1.0 if x == "a" else 0.0, x == "a") for x in "abcdef"]
    res = reference_curate(rows, {"sample": "pods", "sample_fraction": "0.5",
                                  "amplify": "group"})
    sel = res["selections"]
    assert [x for x in "abcdef" if sel[x]["selected"]] == ["a", "e", "f"]
    assert [sel[x]["sample_rank"] for x in "aef"] == [1, 2, 3]
    assert sel["a"]["advantage_raw"] == np.float32((5 / 6) / (math.sqrt(1 / 6) + 1e-6))
    a_sub = np.float32((2 / 3) / (math.sqrt(1 / 3) + 1e-6))
    w = 1 / (2 * math.sqrt((1 / 3) * (2 / 3)))                        # subset p = 1/3
    assert sel["a"]["amplification"] == np.float32(w)
    assert sel["a"]["advantage_final"] == np.float32(w * float(a_sub))
    assert sel["e"]["advantage_final"] == np.float32((-1 / 3) / (math.sqrt(1 / 3) + 1e-6))
    assert sel["b"]["reason"] == "not_selected" and sel["b"]["sample_rank"] is None
    assert sel["b"]["advantage_final"] == sel["b"]["advantage_raw"]
    rec = res["record"]
    assert rec["sample_budget"] == 3
    raw = [float(sel[x]["advantage_raw"]) for x in "abcdef"]
    assert rec["adv_var_before"] == float(np.var(raw))
