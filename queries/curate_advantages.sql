-- Advantages — group-normalised (docs/curation.md §Advantages) for the rows of {rows}, grouped as in
-- {groups}: A = (r − mean) / (std + ε), ε = 1e-6, std per $std_mode ('sample' ddof 1,
-- 'population', 'none' = Dr. GRPO's r − mean). A group of one, or one whose rewards are all equal
-- as stored, gets A = 0 with no arithmetic. Computed in float64, stored as float32.
CREATE OR REPLACE TEMP TABLE {out} AS
WITH spread AS (
    SELECT r.group_id, fsum(pow(r.reward::DOUBLE - g.r_mean, 2)) AS ss
    FROM {rows} r JOIN {groups} g USING (group_id)
    GROUP BY r.group_id
),
scale AS (
    SELECT g.*,
        CASE $std_mode
            WHEN 'sample'     THEN sqrt(s.ss / (g.g_size - 1)) + 1e-6
            WHEN 'population' THEN sqrt(s.ss / g.g_size) + 1e-6
            ELSE 1.0
        END AS denom
    FROM {groups} g JOIN spread s USING (group_id)
)
SELECT
    r.rollout_id,
    s.g_size,
    s.g_correct,
    CASE
        WHEN s.g_size = 1 OR s.all_equal THEN 0.0::FLOAT
        ELSE ((r.reward::DOUBLE - s.r_mean) / s.denom)::FLOAT
    END AS adv
FROM {rows} r JOIN scale s USING (group_id);
