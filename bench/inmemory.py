"""The in-memory reference: curation written the way a trainer does it, in numpy over Arrow.

What users do today instead of a store: load the batch into memory (pyarrow → numpy), compute
group-normalised advantages, filter and amplify, take the max-variance top-M by a sort and prefix
sums, take the top-κ tokens by |A|·H with `np.partition`, and keep the selected rows with their
loss masks as the training batch — in memory, nothing written, nothing audited.

It follows docs/curation.md closely enough to select the same rollouts and tokens as `rollstore
curate` (tie-breaks by rollout_id and position included, which costs one lexsort), so the
benchmark can report agreement; it is not the brute-force test reference (tests/reference.py),
and it supports only what the benchmarked recipes use: eligibility (invalid only: the recipes'
`truncated=keep`, no lag, no reuse), `std=sample`, `filter=dynamic`, `amplify=da3po`,
`sample=cross_group` and `token=abs_adv_entropy` on a linear schedule.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

EPS = 1e-6
SCALARS = ["rollout_id", "group_id", "prompt_id", "policy_version", "reward", "correct", "verify_error"]
PAYLOAD = ["prompt_token_ids", "response_token_ids", "old_logprobs", "gen_logprobs"]


@dataclass(frozen=True)
class Spec:
    """The stages of a benchmarked recipe (a subset of curate/params)."""

    filter_dynamic: bool = False
    amplify: bool = False
    cross_group: bool = False
    tokens: bool = False
    progress: Fraction = Fraction(0)
    tau: Fraction = Fraction(1, 2)
    w_max: float = 3.0
    window: int = 4
    prior: float = 2.0

    def f(self) -> Fraction:  # sample fraction, linear 0.25 → 1.0
        return Fraction(1, 4) + Fraction(3, 4) * self.progress

    def kappa(self) -> Fraction:  # token fraction, linear 0.2 → 1.0
        return Fraction(1, 5) + Fraction(4, 5) * self.progress


RECIPES = {
    "d3s": lambda t: Spec(cross_group=True, tokens=True, progress=t),
    "d2s": lambda t: Spec(cross_group=True, tokens=True, progress=Fraction(0)),
    "da3po": lambda t: Spec(filter_dynamic=True, amplify=True, progress=t),
    "dapo": lambda t: Spec(filter_dynamic=True, progress=t),
    "grpo": lambda t: Spec(progress=t),
}


def load(paths: list[str], spec: Spec) -> pa.Table:
    """The batch in memory: the columns curation needs plus what the training batch carries."""
    cols = SCALARS + PAYLOAD + (["entropies"] if spec.tokens else [])
    return pa.concat_tables([pq.read_table(p, columns=cols) for p in paths])


def advantages(codes: np.ndarray, reward: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """GRPO advantages (sample std, ε = 1e-6; 0 for a constant group or a group of one), float32."""
    r = reward.astype(np.float64)
    g = np.bincount(codes, minlength=n_groups)
    mean = np.bincount(codes, r, n_groups) / np.maximum(g, 1)
    dev = r - mean[codes]
    ssd = np.bincount(codes, dev * dev, n_groups)
    std = np.sqrt(ssd / np.maximum(g - 1, 1))
    a = dev / (std[codes] + EPS)
    a[(g[codes] == 1) | (ssd[codes] == 0)] = 0.0
    return a.astype(np.float32), g


def max_variance(v: np.ndarray, rid: np.ndarray, m: int) -> np.ndarray:
    """Indices of the max-variance subset of size m: sort, prefix sums, best split j (algorithms §7)."""
    n = len(v)
    order = np.lexsort((rid, -v))  # (v desc, rollout_id asc)
    c = v[order] - v.mean()
    p1 = np.concatenate([[0.0], np.cumsum(c)])
    p2 = np.concatenate([[0.0], np.cumsum(c * c)])
    j = np.arange(m + 1)
    s1 = p1[j] + p1[n] - p1[n - (m - j)]
    s2 = p2[j] + p2[n] - p2[n - (m - j)]
    var = s2 / m - (s1 / m) ** 2
    tied = j[var >= var.max() * (1 - 1e-9) - 1e-12]
    best = tied[np.lexsort((tied, np.abs(2 * tied - m)))[0]]
    return np.concatenate([order[:best], order[n - (m - best):]])


def curate_in_memory(paths: list[str], spec: Spec) -> dict:
    """Select from the rollouts in `paths`; returns the training batch and timings."""
    t0 = time.perf_counter()
    table = load(paths, spec)
    t_load = time.perf_counter() - t0

    valid = (pc.is_valid(table["correct"]).to_numpy(zero_copy_only=False)
             & pc.is_null(table["verify_error"]).to_numpy(zero_copy_only=False))
    rows = np.flatnonzero(valid)
    rid_all = table["rollout_id"].to_numpy(zero_copy_only=False)
    _, codes = np.unique(table["group_id"].to_numpy(zero_copy_only=False)[rows], return_inverse=True)
    n_groups = int(codes.max()) + 1 if len(codes) else 0
    correct_all = pc.fill_null(table["correct"], False).to_numpy(zero_copy_only=False)
    correct = correct_all[rows]
    reward = table["reward"].to_numpy()[rows]
    a_raw, g = advantages(codes, reward, n_groups)
    k = np.bincount(codes, correct, n_groups).astype(np.int64)

    pool = np.ones(len(rows), bool)
    if spec.filter_dynamic:
        pool = (k[codes] > 0) & (k[codes] < g[codes])
    a = a_raw.astype(np.float64)

    if spec.amplify:  # DA3PO: q̂ from the prompt's judged history in the version window
        pv = table["policy_version"].to_numpy()
        cv = int(pv.max())
        lo = cv - spec.window + 1
        prompts, pcode = np.unique(table["prompt_id"].to_numpy(zero_copy_only=False), return_inverse=True)
        hist = valid & (pv >= lo) & (pv <= cv)
        hist_n = np.bincount(pcode[hist], minlength=len(prompts))
        hist_k = np.bincount(pcode[hist], correct_all[hist], len(prompts))
        mu = correct.mean()
        row_prompt = pcode[rows]
        outside = (pv[rows] < lo).astype(np.int64)  # the group's own rows count once, even below the window
        n = hist_n[row_prompt] + outside * g[codes]
        kk = hist_k[row_prompt] + outside * k[codes]
        q = (kk + spec.prior * mu) / (n + spec.prior)
        p = k[codes] / g[codes]
        hard = correct & (a_raw > 0) & (k[codes] * spec.tau.denominator < spec.tau.numerator * g[codes])
        with np.errstate(divide="ignore", invalid="ignore"):
            w = np.where(q == 0, spec.w_max, np.clip(p * (1 - q) / (q * (1 - p)), 1.0, spec.w_max))
        w = np.where(hard & pool, w, 1.0)
        a = (w * a).astype(np.float32).astype(np.float64)

    chosen = np.flatnonzero(pool)
    if spec.cross_group and len(chosen):
        n_pool = len(chosen)
        m = min(n_pool, max(2, math.floor(n_pool * spec.f() + Fraction(1, 2))))
        chosen = chosen[max_variance(a[chosen], rid_all[rows[chosen]].astype("S"), m)]
    chosen = chosen[np.argsort(rid_all[rows[chosen]].astype("S"), kind="stable")]  # rollout_id order
    sel = rows[chosen]
    a_sel = a[chosen]

    batch = table.select(PAYLOAD + ["rollout_id"]).take(pa.array(sel))
    lengths = pc.list_value_length(batch["response_token_ids"]).to_numpy()
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n_tok = int(offsets[-1])
    mask = np.ones(n_tok, bool)
    if spec.tokens and n_tok:
        h = pc.list_flatten(table["entropies"].take(pa.array(sel))).to_numpy().astype(np.float64)
        score = np.repeat(np.abs(a_sel), lengths) * h
        kk = math.ceil(spec.kappa() * n_tok)
        thr = np.partition(score, n_tok - kk)[n_tok - kk]  # the K-th largest score
        mask = score > thr
        ties = np.flatnonzero(score == thr)[: kk - int(mask.sum())]  # (rollout_id, pos) order
        mask[ties] = True
    kept = np.add.reduceat(mask, offsets[:-1]) if len(sel) else np.zeros(0, np.int64)
    batch = batch.append_column("advantage", pa.array(a_sel.astype(np.float32)))
    batch = batch.append_column("loss_mask", pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                                                      pa.array(mask)))
    return {"batch": batch, "tokens_kept": kept, "load_seconds": t_load, "tokens_in": int(
        pc.sum(pc.list_value_length(table["response_token_ids"])).as_py() or 0)}
