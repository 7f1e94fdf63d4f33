-- Group statistics (docs/curation.md §Group statistics) over the rows of {rows}:
-- G_g rows, k correct, whether every reward is equal as stored (float32), and the reward mean
-- (float64, compensated summation). Used on the eligible rows and again on a PODS subset.
CREATE OR REPLACE TEMP TABLE {out} AS
SELECT
    group_id,
    count(*)::INTEGER                               AS g_size,
    count(*) FILTER (WHERE correct)::INTEGER        AS g_correct,
    min(reward) = max(reward)                       AS all_equal,
    fsum(reward::DOUBLE) / count(*)                 AS r_mean
FROM {rows}
GROUP BY group_id;
