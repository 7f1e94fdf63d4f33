-- Token scores (D3S arXiv 2509.22115; 80/20 rule arXiv 2506.01939; docs/curation.md §Token
-- selection): one row per response token of a selected row, score = |advantage_final| · H (float64
-- from the stored float32 values) or H alone, per {score}. Views over `selected_entropies`, so they
-- cost nothing until the threshold passes stream over them. `bucket` is a monotone key of the score
-- (64 buckets per octave: floor(64·log2 score); 0 has its own lowest bucket) for the exact two-pass
-- top-K threshold: a histogram finds the bucket holding the K-th token, then only that bucket is
-- sorted. A cheap key on purpose: it is computed for every token in the histogram pass.
-- `token_score_bucket` is the one definition of the key; `token_buckets` is what the histogram pass
-- reads (the key alone: no token position, no rollout_id, so one unnest per row instead of two);
-- `token_scores` is what the bucket pass reads.
CREATE OR REPLACE TEMP MACRO token_score_bucket(score) AS
    CASE WHEN score = 0 THEN -9223372036854775807 ELSE floor(log2(score) * 64)::BIGINT END;
CREATE OR REPLACE TEMP VIEW token_buckets AS
WITH tokens AS (
    SELECT unnest(entropies) AS h, advantage_final
    FROM selected_entropies
)
SELECT token_score_bucket(({score})::DOUBLE) AS bucket
FROM tokens;
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
SELECT rollout_id, pos, score, token_score_bucket(score) AS bucket
FROM scored;
