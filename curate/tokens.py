"""D3S token pruning in one place: the score, the exact top-K threshold, the loss mask.

A newcomer reads token pruning here and in four SQL files, in the order they run:
`curate_token_entropies.sql` (the selected rows' entropies, read from Parquet once),
`curate_token_scores.sql` (one score per token: |A|·H or H, and its monotone `bucket`),
`curate_token_histogram.sql` + `curate_token_bucket.sql` (the K-th token in (score desc,
rollout_id asc, position asc) order, K = ⌈κ·N⌉, in two passes over the in-session table), then
`curate_tokens_kept.sql` (tokens kept per row: a token is kept when its order is not after the
K-th token's). `curate_materialise.sql` hands each selected row's entropies to `keep_runs`, which
writes the same mask as kept runs in numpy (a `list_filter` over mask positions in SQL cost twice
the rest of the materialisation).

Invariants:
- The threshold is exact: histogram counts add up exactly across shards (`merge_histograms`), and
  the K-th token lies in the heads of its bucket, whichever shards they come from (`threshold_of`).
  Both rest on the bucket key being monotone in the score; the engines check the result anyway
  (`check_exact`: the mask keeps exactly K tokens) before anything is written.
- The score and kept-count expressions below are the only SQL text of token pruning outside those
  files; they are fragments of the plan, so they are hashed into the curation id.
- `keep_runs` applies the kept-count predicate to the same float64 scores; before anything is
  committed the engines check that the runs written keep as many tokens as the audit counted
  (`check_kept`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .params import CurationError

FILL_ENTROPIES = "`rollstore generate` fills entropies (learner scoring) when it writes rollouts"


def score_expression(token: str, entropy: str = "h", advantage: str = "advantage_final") -> str:
    """The per-token score: H (token=entropy) or |A|·H (token=abs_adv_entropy), in float64."""
    if token == "entropy":
        return f"{entropy}::DOUBLE"
    return f"abs({advantage}::DOUBLE) * {entropy}::DOUBLE"


def _per_row(token: str, over: str) -> str:
    """`over` (a format with {lam}: a list function of `e.entropies`) applied with the predicate
    "this token is not after the K-th token". The rollout_id part of the (score desc, rollout_id
    asc, position asc) order is the same for every token of a row, so it is decided once per row:
    rows before the K-th token's row keep score ≥ $thr, rows after it keep score > $thr, and only
    the K-th token's own row compares positions."""
    score = score_expression(token, "h", "e.advantage_final")
    return (f"CASE WHEN e.rollout_id < $thr_rollout THEN {over.format(lam=f'lambda h: ({score}) >= $thr')} "
            f"WHEN e.rollout_id > $thr_rollout THEN {over.format(lam=f'lambda h: ({score}) > $thr')} "
            f"ELSE {over.format(lam=f'lambda h, i: ({score}) > $thr OR (({score}) = $thr AND i <= $thr_pos)')} END")


KEEP_RUNS_CHUNK_TOKENS = 1 << 19


def keep_runs(rows: pa.Table, token: str, values: dict) -> pa.Array:
    """`_keep_runs` over consecutive slices of about KEEP_RUNS_CHUNK_TOKENS tokens: the same
    result; its float64 scores stay small enough to be reused from the allocator instead of
    mapping fresh memory per call (which cost as much as the arithmetic)."""
    tokens = rows.column("tokens").to_numpy(zero_copy_only=False).astype(np.int64)
    ends = np.cumsum(tokens)
    cuts = [0]
    while cuts[-1] < rows.num_rows:
        limit = (ends[cuts[-1] - 1] if cuts[-1] else 0) + KEEP_RUNS_CHUNK_TOKENS
        cuts.append(max(cuts[-1] + 1, int(np.searchsorted(ends, limit, side="right"))))
    if len(cuts) <= 2:
        return _keep_runs(rows, token, values)
    parts = [_keep_runs(rows.slice(a, b - a), token, values) for a, b in zip(cuts[:-1], cuts[1:])]
    return pa.concat_arrays(parts)


def _keep_runs(rows: pa.Table, token: str, values: dict) -> pa.Array:
    """The loss masks of selected rows as kept runs [s0, e0, s1, e1, ...] (0-based, end exclusive):
    the same predicate as `kept_expression`, in numpy over the rows' stored entropies. `rows` holds
    rollout_id, advantage (advantage_final), tokens and entropies (null without a token stage, when
    every token is kept); `values` the threshold ($thr, $thr_rollout, $thr_pos). The score is
    the same float64 as in SQL: a product of two float32 values is exact in float64, and strings
    compare bytewise in DuckDB and Arrow alike."""
    tokens = rows.column("tokens").to_numpy(zero_copy_only=False).astype(np.int64)
    n = len(tokens)
    if token == "none":
        full = tokens > 0
        counts = 2 * full.astype(np.int64)
        bounds = np.zeros(int(counts.sum()), np.int32)
        bounds[1::2] = tokens[full]
        return _lists(counts, bounds)
    ents = rows.column("entropies").combine_chunks()
    h = ents.flatten().to_numpy(zero_copy_only=False)
    if len(h) == 0:  # no row has a token: no runs
        return _lists(np.zeros(n, np.int64), np.zeros(0, np.int32))
    offsets = ents.offsets.to_numpy().astype(np.int64)
    offsets -= offsets[0]
    lens = np.diff(offsets)
    bad = np.flatnonzero((lens != tokens) | ents.is_null().to_numpy(zero_copy_only=False))
    if len(bad):
        raise CurationError(f"rollout_id={rows.column('rollout_id')[int(bad[0])].as_py()!r}: column 'entropies' holds "
                            f"{int(lens[bad[0]])} values, its response has {int(tokens[bad[0]])} tokens; nothing "
                            "was written (please report this)")
    if token == "entropy":
        score = h.astype(np.float64)
    else:  # |A|·h, written into the repeated |A| (one float64 array per call: fresh memory is slow)
        score = np.repeat(np.abs(rows.column("advantage").to_numpy(zero_copy_only=False).astype(np.float64)), lens)
        np.multiply(score, h, out=score)
    thr = values["thr"]
    keep = score > thr
    ties = np.flatnonzero(score == thr)  # rare: decided by the row's place against the K-th token's
    if len(ties):
        rid = rows.column("rollout_id")
        row = np.searchsorted(offsets, ties, side="right") - 1
        before = pc.less(rid, values["thr_rollout"]).to_numpy(zero_copy_only=False)[row]
        at = pc.equal(rid, values["thr_rollout"]).to_numpy(zero_copy_only=False)[row]
        keep[ties] = before | (at & (ties - offsets[row] < values["thr_pos"]))
    # A run starts at a kept token whose predecessor is not kept or is in another row, and ends
    # (exclusive) after a kept token whose successor is not kept or is in another row: O(tokens)
    # masks, no sort (a sort of the starts and row-boundary splits cost as much as all the rest).
    first, last = offsets[:-1][lens > 0], offsets[1:][lens > 0] - 1
    opens, closes = keep.copy(), keep.copy()
    opens[1:] &= ~keep[:-1]
    closes[:-1] &= ~keep[1:]
    opens[first], closes[last] = keep[first], keep[last]
    starts, ends = np.flatnonzero(opens), np.flatnonzero(closes) + 1
    per_row = np.diff(np.searchsorted(starts, offsets))  # runs of each row (its starts lie in it)
    base = np.repeat(offsets[:-1], per_row)
    bounds = np.empty(2 * len(starts), np.int32)
    bounds[0::2] = starts - base
    bounds[1::2] = ends - base
    return _lists(2 * per_row, bounds)


def check_kept(written: int, counted: int) -> None:
    """The loss masks written (kept runs, numpy) keep as many tokens as the audit counted (SQL)."""
    if written != counted:
        raise CurationError(f"the curated loss masks keep {written} tokens, the audit counts {counted}; "
                            "nothing was written (please report this)")


def _lists(counts: np.ndarray, values: np.ndarray) -> pa.Array:
    offsets = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.int32()))


def run_lengths(runs: pa.Array) -> np.ndarray:
    """Tokens kept per row of kept runs."""
    bounds = runs.values.to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = runs.offsets.to_numpy().astype(np.int64)
    per_run = bounds[1::2] - bounds[0::2]
    cum = np.concatenate([[0], np.cumsum(per_run)])
    return cum[offsets[1:] // 2] - cum[offsets[:-1] // 2]


def kept_expression(token: str) -> str:
    """Tokens kept by a selected row: the true entries of its mask (all of them without a token
    stage), counted with the predicate of `keep_runs`, without building the mask."""
    if token == "none":
        return "w.tokens_total"
    return _per_row(token, "len(list_filter(e.entropies, {lam}))")


def merge_histograms(histograms: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """Summed (bucket, count) histograms, highest bucket first."""
    merged: dict[int, int] = {}
    for hist in histograms:
        for bucket, n in hist:
            merged[int(bucket)] = merged.get(int(bucket), 0) + int(n)
    return sorted(merged.items(), reverse=True)


def pick_bucket(hist: list[tuple[int, int]], k: int) -> tuple[int, int] | None:
    """(bucket, offset inside it) of the K-th token, from the histogram highest bucket first."""
    if k <= 0:
        return None
    above = 0
    for bucket, n in hist:
        if above + n >= k:
            return bucket, k - above - 1
        above += n
    return None


def threshold_of(heads: list[pa.Table], offset: int) -> tuple[float, str, int]:
    """The K-th token: row `offset` of the bucket's heads (each shard's first offset+1 tokens of
    the bucket, curate_token_bucket.sql) merged in (score desc, rollout_id asc, position asc) order."""
    table = pa.concat_tables(heads) if len(heads) > 1 else heads[0]
    order = pc.sort_indices(table, [("score", "descending"), ("rollout_id", "ascending"), ("pos", "ascending")])
    row = table.take(order).slice(offset, 1).to_pylist()[0]
    return float(row["score"]), str(row["rollout_id"]), int(row["pos"])


def mask_values(threshold: tuple[float, str, int] | None) -> dict:
    """The $thr, $thr_rollout, $thr_pos values of the mask (no threshold: no token is kept)."""
    return {
        "thr": threshold[0] if threshold else float("inf"),
        "thr_rollout": threshold[1] if threshold else "",
        "thr_pos": threshold[2] if threshold else 0,
    }


def check_exact(k: int, tokens_kept: int) -> None:
    """The threshold's proof: the order is strict, so the mask keeps exactly K tokens iff the
    threshold is the K-th token. A bucket key that broke monotonicity (the only way the two passes
    could miss) is caught here, before anything is written."""
    if tokens_kept != k:
        raise CurationError(
            f"token threshold is not exact: the mask keeps {tokens_kept} tokens, the budget K is {k}; "
            "nothing was written (please report this with the recipe and `rollstore recipes --explain`)"
        )


def missing_entropies_error(rollout_id: str, token: str) -> CurationError:
    return CurationError(
        f"rollout_id={rollout_id!r}: column 'entropies' is null, but token={token} needs "
        f"per-token entropies; {FILL_ENTROPIES} (or run with --set token=none)"
    )
