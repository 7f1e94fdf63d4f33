-- Pre-rollout prompt selection's state, when the catalog keeps it (storage/prompt_state.py): the groups
-- run $run generated at its newest selected step $last_step, read from the shards that hold that step
-- ({rollouts}): how many, and how many were all-correct / all-wrong zero-variance groups. The same
-- counts as prompt_skip_state.sql's last three columns.
WITH groups_of AS (
    SELECT group_id, min(reward) = max(reward) AS zero_variance,
           bool_and(coalesce(correct, false)) AS all_correct
    FROM {rollouts} AS rollouts
    WHERE run_id = $run AND step = $last_step
    GROUP BY group_id
)
SELECT count(*) AS groups,
       count(*) FILTER (WHERE zero_variance AND all_correct) AS all_correct,
       count(*) FILTER (WHERE zero_variance AND NOT all_correct) AS all_wrong
FROM groups_of
