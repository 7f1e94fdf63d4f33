"""D3S token pruning in one place: the score, the exact top-K threshold, the kept counts, the loss mask.

A newcomer reads token pruning here, in the order it runs: `curate_selected_rows.sql` (a view:
the selected rows, each with its input shard and position), then four kernel steps
(`curate.kernels`) over those rows' entropies, read from the shards with pyarrow and decoded once
into float64 scores (`scored`): `first_missing` (the input check: the first row, by rollout_id,
whose entropies are null or not finite), `histogram` + `heads` (the K-th token in (score desc,
rollout_id asc, position asc) order, K = ⌈κ·N⌉, in two passes whose partial results merge exactly
across shards), `kept_counts` (tokens kept per row: a token is kept when its order is not after
the K-th token's). The materialisation reads each selected row's entropies the same way (kernel
`entropies`) and hands them to `keep_runs`, which writes the same mask as kept runs.
`kept_expression` is the same predicate in SQL (with token=none the one used: every token; the
tests' reference otherwise).

Invariants:
- The score is the SQL score `score_expression` to the bit: a float32 widened to float64, times
  |A| widened the same way, rounded once (as DuckDB's DOUBLE multiply); -0 is made +0 (equal to it
  in every comparison).
- The threshold is exact: histogram counts add up exactly across shards (`merge_histograms`), and
  the K-th token lies in the heads of its bucket, whichever shards they come from (`threshold_of`).
  Both rest on the bucket key being monotone in the score (`Scored.key`: the float64's bits as an
  ordered integer, so it is, for every finite score); the engines check the result anyway
  (`check_exact`: the kept counts add up to exactly K) before anything is written.
- `keep_runs` and `kept_counts` apply the same predicate to the same float64 scores; before
  anything is committed the engines check that the runs written keep as many tokens as the audit
  counted (`check_kept`).
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
    the bucket, the kernel `heads`) merged in (score desc, rollout_id asc, position asc) order."""
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


# --- The threshold and the kept counts in numpy (kernel steps token_histogram, token_heads,
# tokens_kept; curate.kernels) over the selected rows' entropies, decoded once per session. ---

SCORED_ROWS = 8192  # selected rows decoded at a time (a chunk's arrays stay small)
SCORED_CACHE_TOKENS = 1 << 24  # a session keeps its decoded chunks (16 B a token) for the next pass up to this many tokens
_SIGN = np.int64(0x7FFF_FFFF_FFFF_FFFF)
BUCKET_SHIFT = 46  # 52 mantissa bits less 6: 64 buckets per octave of the score


class Scored:
    """One chunk of selected rows of one input shard (`filename`): every token's float64 score
    (flattened), the rows' offsets into it (int64, rows + 1), their rollout_ids (Arrow strings,
    compared bytewise as in DuckDB), and the rows (indices) whose entropies are null (`absent`) or
    hold a NaN or an infinity (`non_finite`)."""

    def __init__(self, score: np.ndarray, offsets: np.ndarray, rollout_id: pa.Array, filename: str = "",
                 absent: np.ndarray | None = None, non_finite: np.ndarray | None = None):
        self.score, self.offsets, self.rollout_id, self.filename = score, offsets, rollout_id, filename
        self.absent = np.zeros(0, np.int64) if absent is None else absent
        self.non_finite = np.zeros(0, np.int64) if non_finite is None else non_finite
        self._key = None

    @property
    def key(self) -> np.ndarray:
        """The bucket key of each score: monotone in the score (the IEEE order of the float64 as a
        signed integer, its top 6 mantissa bits kept), so every token of a bucket sorts between the
        tokens of the buckets around it; equal scores have equal keys (-0 is made +0 first)."""
        if self._key is None:
            bits = self.score.view(np.int64)
            key = bits ^ ((bits >> 63) & _SIGN)
            np.right_shift(key, BUCKET_SHIFT, out=key)
            self._key = key
        return self._key

    def rows_of(self, tokens: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, tokens, side="right") - 1


def scored(batch: pa.RecordBatch | pa.Table, token: str, filename: str = "") -> Scored:
    """The scores of a chunk of selected rows (rollout_id, advantage_final, entropies) of input shard
    `filename`: H, or |A|·H, in float64 exactly as `score_expression` computes them in SQL (a
    float32 widened to float64 is exact, and so is the product rounded once to float64, as DuckDB's
    DOUBLE multiply); with the rows whose entropies are null, or hold a NaN or an infinity (a null
    element reads as NaN), for `first_missing`."""
    ents = batch.column("entropies")
    ents = ents.combine_chunks() if isinstance(ents, pa.ChunkedArray) else ents
    h = ents.flatten().to_numpy(zero_copy_only=False)  # a null row's slot holds nothing
    absent = np.zeros(0, np.int64)
    if ents.null_count:
        absent = np.flatnonzero(ents.is_null().to_numpy(zero_copy_only=False))
        lens = pc.fill_null(pc.list_value_length(ents), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
    else:
        offsets = ents.offsets.to_numpy().astype(np.int64)
        offsets -= offsets[0]
    if token == "entropy":
        score = h.astype(np.float64)
    else:
        adv = batch.column("advantage_final").to_numpy(zero_copy_only=False).astype(np.float64)
        score = np.repeat(np.abs(adv), np.diff(offsets))
        np.multiply(score, h, out=score)
    np.add(score, 0.0, out=score)  # -0 → +0 (equal scores, one bucket key); every other value unchanged
    finite = np.isfinite(h)
    non_finite = np.zeros(0, np.int64)
    if not finite.all():
        non_finite = np.unique(np.searchsorted(offsets, np.flatnonzero(~finite), side="right") - 1)
    rid = batch.column("rollout_id")
    return Scored(score, offsets, rid.combine_chunks() if isinstance(rid, pa.ChunkedArray) else rid, filename,
                  absent, non_finite)


MISSING_SCHEMA = pa.schema([("rollout_id", pa.string()), ("missing", pa.bool_()), ("filename", pa.string())])


def first_missing(chunks, values: dict, args: dict) -> pa.Table:
    """The input check of the token stage (merge `first_missing`): the first selected row (by
    rollout_id) whose entropies are null (`missing`) or hold a NaN or an infinity, with its input
    shard; no row when every selected row has finite entropies."""
    found = None
    for c in chunks:
        for rows, missing in ((c.absent, True), (c.non_finite, False)):
            for r in rows.tolist():
                row = (c.rollout_id[r].as_py(), missing, c.filename)
                if found is None or row[0] < found[0]:
                    found = row
    if found is None:
        return MISSING_SCHEMA.empty_table()
    return pa.table({"rollout_id": [found[0]], "missing": [found[1]], "filename": [found[2]]}, schema=MISSING_SCHEMA)


def histogram(chunks, values: dict, args: dict) -> pa.Table:
    """Threshold pass 1 (merge `histogram`): tokens per bucket key, highest first."""
    parts = []  # (lowest key, counts from it) per chunk
    for c in chunks:
        if len(c.key):
            low = int(c.key.min())  # keys span at most 2^18 values (sign, 11 exponent and 6 mantissa bits)
            parts.append((low, np.bincount(c.key - low)))
    if not parts:
        return pa.table({"bucket": pa.array([], pa.int64()), "n": pa.array([], pa.int64())})
    low = min(p[0] for p in parts)
    total = np.zeros(max(p[0] + len(p[1]) for p in parts) - low, np.int64)
    for start, n in parts:
        total[start - low:start - low + len(n)] += n
    hit = np.flatnonzero(total)[::-1]  # highest first
    return pa.table({"bucket": pa.array(hit + low, pa.int64()), "n": pa.array(total[hit], pa.int64())})


HEADS_SCHEMA = pa.schema([("score", pa.float64()), ("rollout_id", pa.string()), ("pos", pa.int64())])


def heads(chunks, values: dict, args: dict) -> pa.Table:
    """Threshold pass 2 (merge `heads`): the first $n tokens of bucket $bucket in the threshold's
    order (score desc, rollout_id asc, position asc; positions from 1)."""
    bucket, n = values["bucket"], values["n"]
    parts = []
    for c in chunks:
        idx = np.flatnonzero(c.key == bucket)
        if len(idx):
            row = c.rows_of(idx)
            parts.append(pa.table({"score": pa.array(c.score[idx]),
                                   "rollout_id": c.rollout_id.take(pa.array(row)).cast(pa.string()),
                                   "pos": pa.array(idx - c.offsets[row] + 1)}, schema=HEADS_SCHEMA))
    if not parts:
        return HEADS_SCHEMA.empty_table()
    table = pa.concat_tables(parts)
    order = pc.sort_indices(table, [("score", "descending"), ("rollout_id", "ascending"), ("pos", "ascending")])
    return table.take(order[:n])


def kept_counts(chunks, values: dict, args: dict) -> pa.Table:
    """Tokens kept per selected row, with the predicate of `kept_expression` (and `keep_runs`):
    score > $thr, or score = $thr and (rollout_id, position) not after ($thr_rollout, $thr_pos)."""
    thr, thr_rollout, thr_pos = values["thr"], values["thr_rollout"], values["thr_pos"]
    ids, kept = [], []
    for c in chunks:
        keep = c.score > thr
        ties = np.flatnonzero(c.score == thr)  # rare: decided by the row's place against the K-th token's
        if len(ties):
            row = c.rows_of(ties)
            before = pc.less(c.rollout_id, thr_rollout).to_numpy(zero_copy_only=False)[row]
            at = pc.equal(c.rollout_id, thr_rollout).to_numpy(zero_copy_only=False)[row]
            keep[ties] = before | (at & (ties - c.offsets[row] < thr_pos))
        total = np.zeros(len(keep) + 1, np.int64)
        np.cumsum(keep, out=total[1:])
        ids.append(c.rollout_id.cast(pa.string()))
        kept.append(pa.array((total[c.offsets[1:]] - total[c.offsets[:-1]]).astype(np.int32)))
    return pa.table({"rollout_id": pa.chunked_array(ids, pa.string()),
                     "tokens_kept": pa.chunked_array(kept, pa.int32())})
