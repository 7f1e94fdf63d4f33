-- Replay (docs/replay.md): which rows of the window enter the pool beside the fresh batch. Window rows
-- (`replayed`) still eligible keep the advantage of their own group as generated (curate_advantages.sql
-- over their group's rows); a fresh row is never dropped here. Priorities decay by age a ≥ 1:
-- decay = $replay_decay^(a − 1), in float64.
--   $replay_mode 'groups' (POPO-style): Z = the fresh groups with p ∈ {0, 1} (zero variance, judged on
--     `correct`). Up to |Z| effective window groups (0 < k < G and some advantage ≠ 0) enter whole —
--     every eligible row — ranked by priority = population std of the group's rewards · decay,
--     rounded to float32 (the float64 std depends on row order in its last bits), desc, then
--     group_id asc.
--   $replay_mode 'rollouts': up to $replay_count window rows with |advantage_raw| > 0 (every fresh
--     row in the pool when $replay_count is null), ranked by |advantage_raw| · decay desc, then
--     rollout_id asc.
--   $replay_mode 'window' (the naive baseline): every eligible window row enters, no priority.
-- Output `replay_choice`: one row per window row of the pool, `chosen` or not, and its `priority`.
CREATE OR REPLACE TEMP TABLE replay_choice AS
WITH window_rows AS (
    SELECT rollout_id, group_id, reward, g_correct, group_size, advantage_raw,
           pow($replay_decay::DOUBLE, age - 1) AS decay
    FROM work
    WHERE replayed AND reason IS NULL
),
zero_groups AS (
    SELECT count(DISTINCT group_id) AS z
    FROM work
    WHERE NOT replayed AND group_size IS NOT NULL AND (g_correct = 0 OR g_correct = group_size)
),
fresh_pool AS (
    SELECT count(*) AS n FROM work WHERE NOT replayed AND reason IS NULL
),
group_priority AS (
    SELECT group_id,
           (stddev_pop(reward::DOUBLE) * any_value(decay))::FLOAT AS priority,  -- float32: row order cannot split ties
           any_value(g_correct) AS k, any_value(group_size) AS g,
           max(abs(advantage_raw)) AS top_adv
    FROM window_rows
    GROUP BY group_id
),
groups_ranked AS (
    SELECT group_id, priority,
           row_number() OVER (ORDER BY priority DESC, group_id ASC) AS rank
    FROM group_priority
    WHERE k > 0 AND k < g AND top_adv > 0
),
rows_ranked AS (
    SELECT rollout_id, abs(advantage_raw::DOUBLE) * decay AS priority,
           row_number() OVER (ORDER BY abs(advantage_raw::DOUBLE) * decay DESC, rollout_id ASC) AS rank
    FROM window_rows
    WHERE advantage_raw <> 0
)
SELECT
    w.rollout_id,
    CASE $replay_mode
        WHEN 'groups' THEN coalesce(g.rank <= (SELECT z FROM zero_groups), false)
        WHEN 'window' THEN true
        ELSE coalesce(r.rank <= coalesce($replay_count, (SELECT n FROM fresh_pool)), false)
    END AS chosen,
    CASE $replay_mode WHEN 'groups' THEN g.priority WHEN 'rollouts' THEN r.priority END AS priority
FROM window_rows w
LEFT JOIN groups_ranked g USING (group_id)
LEFT JOIN rows_ranked r USING (rollout_id);
