-- Was the predictor right? For every prompt pre-rollout selection skipped (prompt_selections, decision
-- 'skip'), the first group of that prompt the same run generated at a later step, and whether it was
-- informative (rewards not all equal). A skip whose prompt was never generated again has no row.
WITH groups_of AS (
    SELECT run_id, prompt_id, group_id, min(step) AS step, min(reward) <> max(reward) AS informative
    FROM rollouts
    GROUP BY run_id, prompt_id, group_id
), skips AS (
    SELECT DISTINCT run_id, step, prompt_id FROM prompt_selections WHERE decision = 'skip'
)
SELECT s.run_id, s.step AS skipped_at, s.prompt_id,
       min(g.step) AS next_step, arg_min(g.informative, g.step) AS next_informative
FROM skips s JOIN groups_of g ON g.run_id = s.run_id AND g.prompt_id = s.prompt_id AND g.step > s.step
GROUP BY s.run_id, s.step, s.prompt_id
ORDER BY s.run_id, s.step, s.prompt_id
