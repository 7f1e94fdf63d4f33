-- Group statistics and advantages (docs/curation.md §Group statistics, §Advantages) for the rows
-- of {rows}, in one statement (used on the eligible rows and again on a PODS subset):
-- per group G_g rows, k correct, whether every reward is equal as stored (float32), and the reward
-- mean (float64, compensated summation); then A = (r − mean) / (std + ε), ε = 1e-6, std per
-- $std_mode ('sample' ddof 1, 'population', 'none' = Dr. GRPO's r − mean). A group of one, or one
-- whose rewards are all equal as stored, gets A = 0 with no arithmetic. Computed in float64,
-- stored as float32.
CREATE OR REPLACE TEMP TABLE {out} AS
WITH groups AS (
    SELECT
        group_id,
        count(*)::INTEGER                               AS g_size,
        count(*) FILTER (WHERE correct)::INTEGER        AS g_correct,
        min(reward) = max(reward)                       AS all_equal,
        fsum(reward::DOUBLE) / count(*)                 AS r_mean
    FROM {rows}
    GROUP BY group_id
),
spread AS (
    SELECT r.group_id, fsum(pow(r.reward::DOUBLE - g.r_mean, 2)) AS ss
    FROM {rows} r JOIN groups g USING (group_id)
    GROUP BY r.group_id
),
scale AS (
    SELECT g.*,
        CASE $std_mode
            WHEN 'sample'     THEN sqrt(s.ss / (g.g_size - 1)) + 1e-6
            WHEN 'population' THEN sqrt(s.ss / g.g_size) + 1e-6
            ELSE 1.0
        END AS denom
    FROM groups g JOIN spread s USING (group_id)
)
SELECT
    r.rollout_id,
    s.g_size,
    s.g_correct,
    CASE
        WHEN s.g_size = 1 OR s.all_equal THEN 0.0::FLOAT
        ELSE ((r.reward::DOUBLE - s.r_mean) / s.denom)::FLOAT
    END AS adv
FROM {rows} r JOIN scale s USING (group_id)
ORDER BY r.rollout_id;  -- the order of `work`: curate_filter.sql updates it in place
