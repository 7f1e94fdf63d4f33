-- Pre-rollout prompt selection: the run's newest selection before step $step (its rates), and what
-- that step then generated: its groups, and how many were all-correct / all-wrong zero-variance groups.
-- No row when the run has no selection record yet (the rates start at skip_explore_start).
WITH last AS (
    SELECT step, any_value(explore_easy) AS explore_easy, any_value(explore_hard) AS explore_hard
    FROM prompt_selections
    WHERE run_id = $run AND step < $step
    GROUP BY step
    ORDER BY step DESC
    LIMIT 1
), groups_of AS (
    SELECT group_id, min(reward) = max(reward) AS zero_variance,
           bool_and(coalesce(correct, false)) AS all_correct
    FROM rollouts
    WHERE run_id = $run AND step = (SELECT step FROM last)
    GROUP BY group_id
)
SELECT last.step, last.explore_easy, last.explore_hard,
       (SELECT count(*) FROM groups_of) AS groups,
       (SELECT count(*) FROM groups_of WHERE zero_variance AND all_correct) AS all_correct,
       (SELECT count(*) FROM groups_of WHERE zero_variance AND NOT all_correct) AS all_wrong
FROM last
