-- Token scores (D3S arXiv 2509.22115; 80/20 rule arXiv 2506.01939; docs/curation.md §Token
-- selection): one row per response token of a selected row, score = |advantage_final| · H (float64
-- from the stored float32 values) or H alone, per {score}. A view over `selected_entropies`, so it
-- costs nothing until the threshold passes stream over it. `bucket` is a monotone key of the score
-- (64 buckets per octave: floor(64·log2 score); 0 has its own lowest bucket) for the exact two-pass
-- top-K threshold: a histogram finds the bucket holding the K-th token, then only that bucket is
-- sorted. A cheap key on purpose: it is computed for every token in the histogram pass.
CREATE OR REPLACE TEMP VIEW token_scores AS
WITH tokens AS (
    SELECT
        rollout_id,
        unnest(entropies)                                AS h,
        unnest(range(1, len(entropies) + 1))             AS pos,
        advantage_final
    FROM selected_entropies
),
scored AS (
    SELECT rollout_id, pos, ({score})::DOUBLE AS score FROM tokens
)
SELECT
    rollout_id, pos, score,
    CASE WHEN score = 0 THEN -9223372036854775807 ELSE floor(log2(score) * 64)::BIGINT END AS bucket
FROM scored;
