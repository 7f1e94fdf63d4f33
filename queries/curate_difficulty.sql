-- Step 5a — difficulty q̂ per group (algorithms.md 3 and step 5): pooled accuracy of the judged
-- attempts at the group's prompt within the last $window policy versions (any run, any step,
-- whatever their eligibility here), plus the group's own rows that reached step 2 (counted once,
-- even below the window), smoothed by a Beta prior centred on μ (accuracy of the batch's eligible
-- rows) with strength $prior:  q̂ = (Σk + s·μ) / (Σn + s).
CREATE OR REPLACE TEMP TABLE difficulty AS
WITH reached AS (
    SELECT rollout_id, group_id, prompt_id, correct FROM work WHERE group_size IS NOT NULL
),
mu AS (
    SELECT avg(correct::DOUBLE) AS mu FROM reached
),
batch_groups AS (
    SELECT DISTINCT group_id, prompt_id FROM reached
),
history AS (
    SELECT r.rollout_id, r.prompt_id, r.correct
    FROM rollouts r
    WHERE r.correct IS NOT NULL AND r.verify_error IS NULL
      AND r.policy_version BETWEEN $current_version - $window + 1 AND $current_version
      AND r.prompt_id IN (SELECT prompt_id FROM batch_groups)
),
attempts AS (  -- UNION removes the group's own rows already counted by the window
    SELECT g.group_id, h.rollout_id, h.correct FROM batch_groups g JOIN history h USING (prompt_id)
    UNION
    SELECT group_id, rollout_id, correct FROM reached
)
SELECT
    a.group_id,
    count(*)                                        AS n_hist,
    count(*) FILTER (WHERE a.correct)               AS k_hist,
    CASE WHEN count(*) + $prior = 0 THEN NULL
         ELSE (count(*) FILTER (WHERE a.correct) + $prior * any_value(mu.mu)) / (count(*) + $prior)
    END                                             AS q_hat
FROM attempts a, mu
GROUP BY a.group_id;
