-- Step 8a — token scores (D3S arXiv 2509.22115; 80/20 rule arXiv 2506.01939): one row per response
-- token of a selected row, score = |advantage_final| · H (float64 from the stored float32 values)
-- or H alone. A view, so the threshold passes stream over Parquet instead of holding every score.
-- `bucket` is a monotone key of the score (binary exponent and 12 mantissa bits) for the exact
-- two-pass top-K threshold: a histogram finds the bucket holding the K-th token, then only that
-- bucket is sorted.
CREATE OR REPLACE TEMP VIEW token_scores AS
WITH tokens AS (
    SELECT
        w.rollout_id,
        unnest(r.entropies)                              AS h,
        unnest(range(1, len(r.entropies) + 1))           AS pos,
        w.advantage_final
    FROM work w
    JOIN rollouts r USING (rollout_id)
    WHERE w.selected
),
scored AS (
    SELECT rollout_id, pos, ({score})::DOUBLE AS score FROM tokens
)
SELECT
    rollout_id, pos, score,
    CASE WHEN score = 0 THEN -9223372036854775807
         ELSE floor(log2(score))::BIGINT * 4096
              + floor((score / pow(2.0, floor(log2(score))) - 1.0) * 4096)::BIGINT
    END AS bucket
FROM scored;
