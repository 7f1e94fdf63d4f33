"""Brute-force reference implementation of one curation run, for tests only.

Written straight from the design notes' run semantics (steps 1-9; documented in docs/curation.md
§Order of a run and its stage sections), independently of the SQL engine in `queries/` and
`curate/`, which it must never import (but the parameter table's defaults, `curate.params.PARAMETERS`:
data, defined once). Tests run both on the same rows and compare the audit
(`selections`), the loss masks and the curation record.

Invariants this module keeps:
- it is naive on purpose: every max-variance subset is found by computing `np.var` of every
  candidate subset S_j directly, every token selection is one full Python sort, every budget is
  exact rational arithmetic (`fractions.Fraction`), so that it shares no cleverness (prefix sums,
  thresholds, streaming) with the engine it checks;
- every candidate row gets exactly one entry in `selections`, with exactly one reason;
- float fields follow the spec's precision rules: rewards, entropies and every stored value are
  float32 (returned as `np.float32`); each step reads stored float32 values widened to float64.

Where the spec can be read two ways, the literal reading is taken and marked `# AMBIGUOUS:`.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np

from rollstore.curate.params import PARAMETERS

EPS = 1e-6

# The parameter table's defaults (curate/params.py `PARAMETERS`, docs/curation.md §Parameters), for
# keys missing from `params`: the one import from the engine's packages, and it is data.
REPLAY_KEYS = ("replay", "replay_window", "replay_max_uses", "replay_count", "replay_decay")
DEFAULTS = {p.name: p.default for p in PARAMETERS if p.name not in REPLAY_KEYS}

ENTROPY_COMMAND = "the learner's scoring pass (learner/score), which fills `entropies`"


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------

def f32(x) -> np.float32:
    """Store a value as float32 (what a `f32` column holds)."""
    return np.float32(x)


def wide(x) -> float:
    """Read a stored float32 value widened to float64."""
    return float(np.float32(x))


def rid_key(rollout_id: str) -> bytes:
    """rollout_id ordering: binary order of its UTF-8 bytes (not a locale)."""
    return rollout_id.encode("utf-8")


def exact(x) -> Fraction:
    """A fraction or `progress` as the exact decimal written (str, Fraction, int or float)."""
    if isinstance(x, Fraction):
        return x
    if isinstance(x, float):
        # a Python float stands for the decimal literal it prints as (0.07 -> 7/100)
        return Fraction(repr(x))
    return Fraction(str(x))


def round_half_up(x: Fraction) -> int:
    """'Round' of the spec: floor(x + 1/2), exactly."""
    return math.floor(x + Fraction(1, 2))


def optional_int(x):
    if x is None or (isinstance(x, str) and x.lower() == "none"):
        return None
    return int(x)


def pop_var(values) -> float | None:
    """Population variance (ddof 0) in float64; None for an empty set."""
    if len(values) == 0:
        return None
    return float(np.var(np.asarray(values, dtype=np.float64)))


def brute_force_max_variance(values: list[float], M: int) -> float:
    """Max population variance over ALL subsets of size M (itertools.combinations).

    Exponential; only for checking that the top-j ∪ bottom-(M-j) structure reaches the optimum.
    """
    best = -math.inf
    for subset in itertools.combinations(values, M):
        best = max(best, float(np.var(np.asarray(subset, dtype=np.float64))))
    return best


# --------------------------------------------------------------------------------------------
# parameters
# --------------------------------------------------------------------------------------------

def resolve_params(params: dict) -> dict:
    """Effective parameters: defaults for missing keys, exact fractions, ints, None for `none`."""
    p = dict(DEFAULTS)
    p.update(params)
    out = dict(p)
    out["max_policy_lag"] = optional_int(p["max_policy_lag"])
    out["max_reuse"] = optional_int(p["max_reuse"])
    out["amplify_tau"] = exact(p["amplify_tau"])
    out["amplify_max"] = float(exact(p["amplify_max"]))
    out["difficulty_window"] = int(p["difficulty_window"])
    out["difficulty_prior"] = float(exact(p["difficulty_prior"]))
    t = exact(p["progress"])
    out["progress"] = t
    if p["schedule"] == "linear":
        f0, f1 = exact(p["sample_fraction_start"]), exact(p["sample_fraction_end"])
        k0, k1 = exact(p["token_fraction_start"]), exact(p["token_fraction_end"])
        out["f"] = f0 + (f1 - f0) * t
        out["kappa"] = k0 + (k1 - k0) * t
    elif p["schedule"] == "static":
        out["f"] = exact(p["sample_fraction"])
        out["kappa"] = exact(p["token_fraction"])
    else:
        raise ValueError(f"unknown schedule {p['schedule']!r}")
    for name, allowed in (("std", {"sample", "population", "none"}),
                          ("filter", {"none", "dynamic"}),
                          ("amplify", {"none", "da3po", "group"}),
                          ("sample", {"none", "pods", "in_group", "cross_group"}),
                          ("token", {"none", "abs_adv_entropy", "entropy"}),
                          ("truncated", {"keep", "drop"})):
        if p[name] not in allowed:
            raise ValueError(f"unknown {name} {p[name]!r}")
    return out


# --------------------------------------------------------------------------------------------
# step 1: eligibility
# --------------------------------------------------------------------------------------------

def step1_eligibility(rows, prm, current_version, prior_selected_counts) -> dict:
    """rollout_id -> first reason that applies (invalid, truncated, stale, reused) or None."""
    reasons = {}
    lag, max_reuse = prm["max_policy_lag"], prm["max_reuse"]
    for r in rows:
        reason = None
        if r["correct"] is None or r.get("verify_error") is not None:
            reason = "invalid"
        elif prm["truncated"] == "drop" and r["finish_reason"] in ("length", "abort"):
            reason = "truncated"
        elif lag is not None and r["policy_version"] < current_version - lag:
            reason = "stale"
        elif max_reuse is not None and prior_selected_counts.get(r["rollout_id"], 0) >= max_reuse:
            reason = "reused"
        reasons[r["rollout_id"]] = reason
    return reasons


# --------------------------------------------------------------------------------------------
# step 2: group statistics
# --------------------------------------------------------------------------------------------

def step2_group_statistics(remaining) -> tuple[dict, dict, float | None]:
    """Groups of the remaining rows, their (G, k) and the batch accuracy mu."""
    groups: dict[str, list[dict]] = {}
    for r in remaining:
        groups.setdefault(r["group_id"], []).append(r)
    stats = {}
    for gid, members in groups.items():
        G = len(members)
        k = sum(1 for r in members if r["correct"])
        stats[gid] = {"G": G, "k": k}
    if remaining:
        mu = sum(1 for r in remaining if r["correct"]) / len(remaining)
    else:
        mu = None
    return groups, stats, mu


# --------------------------------------------------------------------------------------------
# step 3: advantages (§1)
# --------------------------------------------------------------------------------------------

def step3_advantages(rewards, std_mode) -> list[np.float32]:
    """Group-normalised advantages of float32 rewards, computed in float64, stored as float32."""
    r32 = [f32(x) for x in rewards]
    if len(r32) == 1 or all(x == r32[0] for x in r32):
        return [f32(0.0) for _ in r32]                     # A = 0 with no arithmetic
    # Sums are exactly rounded (math.fsum): the reference aims at the true float64 value; an
    # engine summing in another order may differ in the last float64 bit, rarely 1 float32 ulp.
    r = [float(x) for x in r32]
    n = len(r)
    mean = math.fsum(r) / n
    if std_mode == "none":
        return [f32(x - mean) for x in r]                  # Dr. GRPO: no division, no eps
    ddof = 1 if std_mode == "sample" else 0
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in r) / (n - ddof))
    return [f32((x - mean) / (std + EPS)) for x in r]


# --------------------------------------------------------------------------------------------
# step 4: filter (§2)
# --------------------------------------------------------------------------------------------

def step4_filter(stats, filter_mode) -> set[str]:
    """group_ids that leave the pool with `zero_variance`."""
    if filter_mode != "dynamic":
        return set()
    return {gid for gid, s in stats.items() if s["k"] == 0 or s["k"] == s["G"]}


# --------------------------------------------------------------------------------------------
# step 5: difficulty and amplification (§3)
# --------------------------------------------------------------------------------------------

def step5_difficulty(groups, snapshot_rows, current_version, prm, mu) -> dict:
    """group_id -> q̂ (float64) or None when undefined (Σn + s = 0)."""
    W, s = prm["difficulty_window"], prm["difficulty_prior"]
    lo, hi = current_version - W + 1, current_version
    history: dict[str, dict[str, bool]] = {}               # prompt_id -> {rollout_id: correct}
    for r in snapshot_rows:
        if r["correct"] is None or r.get("verify_error") is not None:
            continue
        if lo <= r["policy_version"] <= hi:
            history.setdefault(r["prompt_id"], {})[r["rollout_id"]] = bool(r["correct"])
    qhat = {}
    for gid, members in groups.items():
        # AMBIGUOUS: "the rows of the current group always count (once)" is read as the group's
        # rows that reached step 2 (eligible candidates). Rows of the same group_id that are not
        # candidates or were made ineligible still count if the history rule itself admits them
        # (judged, in the window); otherwise they do not. Counting "once" = union by rollout_id.
        pooled = dict(history.get(members[0]["prompt_id"], {}))
        for r in members:
            pooled[r["rollout_id"]] = bool(r["correct"])
        n = len(pooled)
        k = sum(1 for c in pooled.values() if c)
        if n + s == 0:
            qhat[gid] = None
        else:
            qhat[gid] = (k + s * mu) / (n + s)
    return qhat


def amplification_factor(k: int, G: int, qhat, prm) -> float:
    """w (float64) for a correct row with advantage > 0 of a group with k of G correct.

    Returns 1.0 when the rule does not apply (p ≥ τ, amplify=none, q̂ undefined).
    """
    mode, w_max = prm["amplify"], prm["amplify_max"]
    # AMBIGUOUS: p < τ is compared exactly (k/G against the decimal τ as written), as the spec
    # asks of fractions in general; comparing float32 group_accuracy would put p = 0.7 below
    # τ = 0.7. In the factor itself p is the float64 of k/G, not the stored float32
    # group_accuracy widened; the two readings differ by at most ~1 float32 ulp in w.
    if mode == "none" or not Fraction(k, G) < prm["amplify_tau"]:
        return 1.0
    p = k / G
    if mode == "group":
        return min(w_max, 1.0 / (2.0 * math.sqrt(p * (1.0 - p))))
    # da3po
    if qhat is None:
        return 1.0
    # AMBIGUOUS: w uses q̂ in float64 as computed in this step, not the stored float32 difficulty.
    if qhat == 0.0:
        return w_max
    raw = p * (1.0 - qhat) / (qhat * (1.0 - p))
    return min(max(raw, 1.0), w_max)


def step5_amplify(pool_rows, out, stats, qhat, prm) -> None:
    """Non-PODS amplification: fills amplification and advantage_final of pool rows."""
    for r in pool_rows:
        sel = out[r["rollout_id"]]
        a_raw = wide(sel["advantage_raw"])
        w = 1.0
        if r["correct"] and a_raw > 0:
            st = stats[r["group_id"]]
            w = amplification_factor(st["k"], st["G"], qhat.get(r["group_id"]), prm)
        sel["amplification"] = f32(w)
        sel["advantage_final"] = f32(w * a_raw)            # w = 1 gives advantage_raw back


# --------------------------------------------------------------------------------------------
# steps 6-7: sample selection and max-variance subset (§4, §5)
# --------------------------------------------------------------------------------------------

def budget(n: int, f: Fraction) -> int:
    """M = min(N, max(2, round(N·f))) (and m_g likewise), exactly."""
    return min(n, max(2, round_half_up(n * f)))


def max_variance_subset(items: list[tuple[float, str]], M: int) -> list[str]:
    """Step 7: the selected rollout_ids, in pool order, from (v, rollout_id) items.

    Pool order is (v desc, rollout_id asc); S_j = first j ∪ last M - j; the variance of each S_j
    is computed directly; ties within V*·(1 - 1e-9) - 1e-12, then smallest |2j - M|, then
    smaller j.
    """
    if M == 0:
        return []
    order = sorted(items, key=lambda it: (-it[0], rid_key(it[1])))
    N = len(order)
    candidates = []
    for j in range(M + 1):
        idx = list(range(j)) + list(range(N - (M - j), N))
        var = float(np.var(np.asarray([order[i][0] for i in idx], dtype=np.float64)))
        candidates.append((j, idx, var))
    v_star = max(c[2] for c in candidates)
    tol = v_star * (1 - 1e-9) - 1e-12
    tied = [c for c in candidates if c[2] >= tol]
    j, idx, _ = min(tied, key=lambda c: (abs(2 * c[0] - M), c[0]))
    return [order[i][1] for i in idx]                      # idx is increasing: pool order


def rank_selected(selected_ids: list[str], out) -> None:
    """sample_rank: 1-based position among the selected rows of the pool, in pool order."""
    for rank, rid in enumerate(selected_ids, start=1):
        out[rid]["sample_rank"] = rank


def step6_sample(pool_rows, out, prm) -> int | None:
    """Non-PODS sample stage on advantage_final. Returns sample_budget (None with sample=none)."""
    mode = prm["sample"]
    # AMBIGUOUS: with an empty pool the spec nulls only the variances and the threshold, so
    # sample_budget is the formula's value, 0 (M = min(0, max(2, 0))), and token_fraction stays κ.
    if mode == "none":
        for r in pool_rows:
            out[r["rollout_id"]]["selected"] = True
        return None
    if mode == "cross_group":
        pools = [pool_rows]
    else:  # in_group
        by_group: dict[str, list[dict]] = {}
        for r in pool_rows:
            by_group.setdefault(r["group_id"], []).append(r)
        pools = list(by_group.values())
    total = 0
    for pool in pools:
        M = budget(len(pool), prm["f"])
        total += M
        items = [(wide(out[r["rollout_id"]]["advantage_final"]), r["rollout_id"]) for r in pool]
        chosen = max_variance_subset(items, M)
        for rid in chosen:
            out[rid]["selected"] = True
        rank_selected(chosen, out)
    return total


def step6_pods(pool_rows, out, stats, qhat, prm) -> int:
    """PODS: select by reward per group → re-normalise on the subset → amplify with subset's p."""
    by_group: dict[str, list[dict]] = {}
    for r in pool_rows:
        by_group.setdefault(r["group_id"], []).append(r)
    total = 0
    for gid, pool in by_group.items():
        m = budget(stats[gid]["G"], prm["f"])
        total += m
        items = [(wide(f32(r["reward"])), r["rollout_id"]) for r in pool]
        chosen = max_variance_subset(items, m)
        rank_selected(chosen, out)
        chosen_rows = [r for rid in chosen for r in pool if r["rollout_id"] == rid]
        # AMBIGUOUS: A_subset is "re-normalised with the run's std" = step 3 applied to the
        # subset, so it is rounded to float32 like advantage_raw before w multiplies it.
        a_sub = step3_advantages([r["reward"] for r in chosen_rows], prm["std"])
        k_sub = sum(1 for r in chosen_rows if r["correct"])
        for r, a in zip(chosen_rows, a_sub):
            sel = out[r["rollout_id"]]
            sel["selected"] = True
            w = 1.0
            if r["correct"] and wide(a) > 0:
                w = amplification_factor(k_sub, len(chosen_rows), qhat.get(gid), prm)
            sel["amplification"] = f32(w)
            sel["advantage_final"] = f32(w * wide(a))
        for r in pool:                                     # not selected: keep the raw values
            sel = out[r["rollout_id"]]
            if not sel["selected"]:
                sel["amplification"] = f32(1.0)
                sel["advantage_final"] = sel["advantage_raw"]
    return total


# --------------------------------------------------------------------------------------------
# step 8: token selection (§5)
# --------------------------------------------------------------------------------------------

def step8_tokens(selected_rows, out, prm) -> tuple[dict, float | None, Fraction | None]:
    """Loss masks of selected rows, the token threshold and κ (None, None with token=none)."""
    masks = {r["rollout_id"]: [True] * len(r["response_token_ids"]) for r in selected_rows}
    if prm["token"] == "none":
        return masks, None, None
    kappa = prm["kappa"]
    triples = []
    for r in selected_rows:
        rid = r["rollout_id"]
        if r.get("entropies") is None:
            raise ValueError(f"rollout {rid} has no entropies: run {ENTROPY_COMMAND} first")
        a = abs(wide(out[rid]["advantage_final"]))
        for pos, h in enumerate(r["entropies"]):
            score = wide(h) if prm["token"] == "entropy" else a * wide(h)
            triples.append((score, rid, pos))
    n_tokens = len(triples)
    K = math.ceil(kappa * n_tokens)                        # exact: Fraction * int
    triples.sort(key=lambda t: (-t[0], rid_key(t[1]), t[2]))
    kept = triples[:K]
    for rid in masks:
        masks[rid] = [False] * len(masks[rid])
    for _, rid, pos in kept:
        masks[rid][pos] = True
    threshold = kept[-1][0] if K > 0 else None
    return masks, threshold, kappa


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------

def empty_selection(r) -> dict:
    return {
        "group_size": None, "group_accuracy": None, "difficulty": None, "advantage_raw": None,
        "amplification": None, "advantage_final": None, "selected": False, "reason": None,
        "sample_rank": None, "tokens_total": len(r["response_token_ids"]), "tokens_kept": 0,
    }


def finish(rows, pool, out, prm, adv_var_before, sample_budget) -> tuple[dict, dict]:
    """Reasons of the pool rows, step 8 (token selection) and step 9 (the record) over the
    candidates `rows`: (masks of the selected rows, record)."""
    for r in pool:
        sel = out[r["rollout_id"]]
        sel["reason"] = "selected" if sel["selected"] else "not_selected"
    selected_rows = [r for r in pool if out[r["rollout_id"]]["selected"]]
    masks, threshold, kappa = step8_tokens(selected_rows, out, prm)
    for rid, mask in masks.items():
        out[rid]["tokens_kept"] = sum(mask)
    record = {
        "sample_budget": sample_budget,
        "token_fraction": kappa,
        "token_threshold": threshold,
        "n_candidates": len(rows),
        "n_selected": len(selected_rows),
        "tokens_candidate": sum(len(r["response_token_ids"]) for r in rows),
        "tokens_kept": sum(out[r["rollout_id"]]["tokens_kept"] for r in selected_rows),
        "adv_var_before": adv_var_before,
        "adv_var_after": pop_var([wide(out[r["rollout_id"]]["advantage_final"])
                                  for r in selected_rows]),
        "old_logprobs_fallback": sum(1 for r in selected_rows if r.get("old_logprobs") is None),
    }
    return masks, record


def reference_curate(rows: list[dict], params: dict, snapshot_rows: list[dict] | None = None,
                     current_version: int | None = None,
                     prior_selected_counts: dict[str, int] | None = None) -> dict:
    """One curation run over `rows` (the batch already matched by `where`).

    Returns {"selections": {rollout_id: audit fields}, "masks": {rollout_id: list[bool]} for
    selected rows, "record": curation record fields of step 9}.
    """
    if not rows:
        raise ValueError("empty batch")
    prm = resolve_params(params)
    if snapshot_rows is None:
        snapshot_rows = rows
    if current_version is None:
        current_version = max(r["policy_version"] for r in snapshot_rows)
    prior_selected_counts = prior_selected_counts or {}

    out = {r["rollout_id"]: empty_selection(r) for r in rows}

    # step 1
    reasons = step1_eligibility(rows, prm, current_version, prior_selected_counts)
    for rid, reason in reasons.items():
        if reason is not None:
            out[rid]["reason"] = reason
    remaining = [r for r in rows if reasons[r["rollout_id"]] is None]

    # step 2
    groups, stats, mu = step2_group_statistics(remaining)
    for gid, members in groups.items():
        for r in members:
            out[r["rollout_id"]]["group_size"] = stats[gid]["G"]
            out[r["rollout_id"]]["group_accuracy"] = f32(stats[gid]["k"] / stats[gid]["G"])

    # step 3
    for gid, members in groups.items():
        for r, a in zip(members, step3_advantages([r["reward"] for r in members], prm["std"])):
            out[r["rollout_id"]]["advantage_raw"] = a

    # step 4
    dropped = step4_filter(stats, prm["filter"])
    for gid in dropped:
        for r in groups[gid]:
            sel = out[r["rollout_id"]]
            sel["reason"] = "zero_variance"
            sel["amplification"] = f32(1.0)
            sel["advantage_final"] = sel["advantage_raw"]
    pool = [r for r in remaining if r["group_id"] not in dropped]

    # step 5 (difficulty for every row that reached step 2; amplification of the pool)
    qhat = {}
    if prm["amplify"] == "da3po" and groups:
        qhat = step5_difficulty(groups, snapshot_rows, current_version, prm, mu)
        for gid, members in groups.items():
            for r in members:
                q = qhat[gid]
                out[r["rollout_id"]]["difficulty"] = None if q is None else f32(q)

    # steps 5-7 (PODS runs amplification after its selection)
    if prm["sample"] == "pods":
        adv_var_before = pop_var([wide(out[r["rollout_id"]]["advantage_raw"]) for r in pool])
        sample_budget = step6_pods(pool, out, stats, qhat, prm)
    else:
        step5_amplify(pool, out, stats, qhat, prm)
        adv_var_before = pop_var([wide(out[r["rollout_id"]]["advantage_final"]) for r in pool])
        sample_budget = step6_sample(pool, out, prm)
    # steps 8-9
    masks, record = finish(rows, pool, out, prm, adv_var_before, sample_budget)
    return {"selections": out, "masks": masks, "record": record}


# --------------------------------------------------------------------------------------------
# replay (docs/replay.md): the window beside the fresh batch
# --------------------------------------------------------------------------------------------

REPLAY_DEFAULTS = {p.name: p.default for p in PARAMETERS if p.name in REPLAY_KEYS}


def reference_replay_curate(snapshot_rows: list[dict], batch_ids: set[str], params: dict, current_version: int,
                            prior_selected_counts: dict[str, int] | None = None) -> dict:
    """One replay curation, brute force: the fresh batch (`batch_ids`) plus the window of its run.

    Returns what `reference_curate` returns, each selection with `replayed`, `age` and `uses`."""
    prm = resolve_params({k: v for k, v in params.items() if k not in REPLAY_DEFAULTS})
    rp = {**REPLAY_DEFAULTS, **{k: v for k, v in params.items() if k in REPLAY_DEFAULTS}}
    mode, W, cap = rp["replay"], int(rp["replay_window"]), int(rp["replay_max_uses"])
    count = optional_int(rp["replay_count"])
    decay = float(exact(rp["replay_decay"]))
    uses = prior_selected_counts or {}
    fresh = [r for r in snapshot_rows if r["rollout_id"] in batch_ids]
    runs = {r["run_id"] for r in fresh}
    window = [r for r in snapshot_rows if r["rollout_id"] not in batch_ids and r["run_id"] in runs
              and 1 <= current_version - r["policy_version"] <= W]
    rows = fresh + window
    replayed = {r["rollout_id"] for r in window}
    out = {r["rollout_id"]: empty_selection(r) for r in rows}
    for r in rows:
        out[r["rollout_id"]].update(replayed=r["rollout_id"] in replayed,
                                    age=current_version - r["policy_version"], uses=uses.get(r["rollout_id"], 0))

    # step 1, then the use cap (the first use included)
    reasons = step1_eligibility(rows, prm, current_version, uses)
    for rid in reasons:
        if reasons[rid] is None and uses.get(rid, 0) >= cap:
            reasons[rid] = "reused"
        out[rid]["reason"] = reasons[rid]
    remaining = [r for r in rows if reasons[r["rollout_id"]] is None]
    # a replayed row at its cap still belongs to its group as generated (statistics, advantages)
    as_generated = [r for r in rows if reasons[r["rollout_id"]] is None
                    or (r["rollout_id"] in replayed and reasons[r["rollout_id"]] == "reused")]

    # steps 2-3 over the groups as generated; audit values only for eligible rows
    groups_all, stats, _ = step2_group_statistics(as_generated)
    advantage = {}
    for gid, members in groups_all.items():
        for r, a in zip(members, step3_advantages([r["reward"] for r in members], prm["std"])):
            advantage[r["rollout_id"]] = a
    groups: dict[str, list[dict]] = {}
    for r in remaining:
        groups.setdefault(r["group_id"], []).append(r)
        st = stats[r["group_id"]]
        sel = out[r["rollout_id"]]
        sel["group_size"], sel["group_accuracy"] = st["G"], f32(st["k"] / st["G"])
        sel["advantage_raw"] = advantage[r["rollout_id"]]
    mu = sum(1 for r in remaining if r["correct"]) / len(remaining) if remaining else None

    # step 4
    dropped = step4_filter({g: stats[g] for g in groups}, prm["filter"])
    for gid in dropped:
        for r in groups[gid]:
            sel = out[r["rollout_id"]]
            sel["reason"], sel["amplification"], sel["advantage_final"] = "zero_variance", f32(1.0), sel["advantage_raw"]
    pool = [r for r in remaining if r["group_id"] not in dropped]

    # replay: which window rows of the pool stay
    fresh_pool = [r for r in pool if r["rollout_id"] not in replayed]
    window_pool = [r for r in pool if r["rollout_id"] in replayed]

    def decayed(r) -> float:
        return decay ** (current_version - r["policy_version"] - 1)

    if mode == "window":
        chosen = {r["rollout_id"] for r in window_pool}
    elif mode == "groups":
        zero = {gid for gid, members in groups.items() if members[0]["rollout_id"] not in replayed
                and stats[gid]["k"] in (0, stats[gid]["G"])}
        by_group: dict[str, list[dict]] = {}
        for r in window_pool:
            by_group.setdefault(r["group_id"], []).append(r)
        ranked = []
        for gid, members in by_group.items():
            st = stats[gid]
            if not (0 < st["k"] < st["G"]) or all(wide(advantage[r["rollout_id"]]) == 0 for r in members):
                continue
            rewards = [float(f32(r["reward"])) for r in members]
            priority = float(f32(float(np.std(np.array(rewards, np.float64))) * decayed(members[0])))
            ranked.append((-priority, gid.encode(), gid))
        ranked.sort()
        keep = {gid for _, _, gid in ranked[:len(zero)]}
        chosen = {r["rollout_id"] for r in window_pool if r["group_id"] in keep}
    elif mode == "rollouts":
        scored = sorted(((-abs(wide(advantage[r["rollout_id"]])) * decayed(r), rid_key(r["rollout_id"]), r["rollout_id"])
                         for r in window_pool if wide(advantage[r["rollout_id"]]) != 0))
        limit = len(fresh_pool) if count is None else count
        chosen = {rid for _, _, rid in scored[:limit]}
    else:
        raise ValueError(mode)
    for r in window_pool:
        if r["rollout_id"] not in chosen:
            out[r["rollout_id"]]["reason"] = "not_selected"
    pool = fresh_pool + [r for r in window_pool if r["rollout_id"] in chosen]

    # steps 5-9 as in reference_curate (no PODS with replay in this reference)
    qhat = {}
    if prm["amplify"] == "da3po" and groups:
        qhat = step5_difficulty(groups, snapshot_rows, current_version, prm, mu)
        for gid, members in groups.items():
            for r in members:
                out[r["rollout_id"]]["difficulty"] = None if qhat[gid] is None else f32(qhat[gid])
    for r in remaining:  # rows that left the pool keep amplification 1 (replay: not chosen)
        sel = out[r["rollout_id"]]
        if sel["reason"] == "not_selected":
            sel["amplification"], sel["advantage_final"] = f32(1.0), sel["advantage_raw"]
    step5_amplify(pool, out, stats, qhat, prm)
    adv_var_before = pop_var([wide(out[r["rollout_id"]]["advantage_final"]) for r in pool])
    sample_budget = step6_sample(pool, out, prm)
    masks, record = finish(rows, pool, out, prm, adv_var_before, sample_budget)
    return {"selections": out, "masks": masks, "record": record}
