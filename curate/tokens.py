"""D3S token pruning in one place: the score, the exact top-K threshold, the loss mask.

A newcomer reads token pruning here and in four SQL files, in the order they run:
`curate_token_entropies.sql` (the selected rows' entropies, read from Parquet once),
`curate_token_scores.sql` (one score per token: |A|·H or H, and its monotone `bucket`),
`curate_token_histogram.sql` + `curate_token_bucket.sql` (the K-th token in (score desc,
rollout_id asc, position asc) order, K = ⌈κ·N⌉, in two passes over the in-session table), then
`curate_tokens_kept.sql` / `curate_materialise.sql` (the mask: a token is kept when its order is not
after the K-th token's).

Invariants:
- The threshold is exact: histogram counts add up exactly across shards (`merge_histograms`), and
  the K-th token lies in the heads of its bucket, whichever shards they come from (`threshold_of`).
  Both rest on the bucket key being monotone in the score; the engines check the result anyway
  (`check_exact`: the mask keeps exactly K tokens) before anything is written.
- The score and mask expressions below are the only SQL text of token pruning outside those files;
  they are fragments of the plan, so they are hashed into the curation id.
"""

from __future__ import annotations

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


def mask_expression(token: str) -> str:
    """The loss mask of a selected row (`e` = its selected_entropies row, `r` its rollout): with a
    token stage, each token's order against the K-th token's ($thr, $thr_rollout, $thr_pos)."""
    if token == "none":
        return "list_transform(range(w.tokens_total), lambda i: true)"
    return _per_row(token, "list_transform(e.entropies, {lam})")


def kept_expression(token: str) -> str:
    """Tokens kept by a selected row: the true entries of its mask (all of them without a token
    stage), counted with the same predicate as `mask_expression`, without building the mask."""
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
