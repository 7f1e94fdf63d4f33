-- Pre-rollout prompt selection's state at step $step of run $run, in one row:
--   recorded      — the stream positions this step already chose to generate (a resumed step
--                   replays them; empty when the step has no selection yet);
--   last_position — the last stream position any earlier step examined (NULL: none yet);
--   last_step     — the run's newest earlier step with a selection, with its rates
--                   (explore_easy, explore_hard) and what that step then generated: its groups,
--                   and how many were all-correct / all-wrong zero-variance groups.
-- With no earlier selection the rates are NULL and start at skip_explore_start.
WITH recorded AS (
    SELECT coalesce(list(position ORDER BY position) FILTER (WHERE step = $step AND decision = 'generate'),
                    []) AS recorded,
           max(position) FILTER (WHERE step < $step) AS last_position,
           max(step) FILTER (WHERE step < $step) AS last_step
    FROM prompt_selections
    WHERE run_id = $run AND step <= $step
), last AS (
    SELECT any_value(explore_easy) AS explore_easy, any_value(explore_hard) AS explore_hard
    FROM prompt_selections
    WHERE run_id = $run AND step = (SELECT last_step FROM recorded)
), groups_of AS (
    SELECT group_id, min(reward) = max(reward) AS zero_variance,
           bool_and(coalesce(correct, false)) AS all_correct
    FROM rollouts
    WHERE run_id = $run AND step = (SELECT last_step FROM recorded)
    GROUP BY group_id
)
SELECT recorded.recorded, recorded.last_position, recorded.last_step, last.explore_easy, last.explore_hard,
       (SELECT count(*) FROM groups_of) AS groups,
       (SELECT count(*) FROM groups_of WHERE zero_variance AND all_correct) AS all_correct,
       (SELECT count(*) FROM groups_of WHERE zero_variance AND NOT all_correct) AS all_wrong
FROM recorded, last
