-- Pre-rollout prompt selection (docs/curation.md §Before generation): per candidate prompt, its newest
-- $skip_window groups sampled in run $run before step $step. A group is zero-variance when all its rewards
-- are equal; z = how many of those groups, consecutive from the newest, were zero-variance (0 when the
-- newest had variance, or the prompt has no history); kind = all_correct or all_wrong, of the newest
-- group, when z > 0. History is per run: other runs' groups of the same prompt are not read.
WITH groups_of AS (
    SELECT prompt_id, group_id, max(step) AS step,
           min(reward) = max(reward) AS zero_variance,
           bool_and(coalesce(correct, false)) AS all_correct
    FROM rollouts
    WHERE run_id = $run AND step < $step AND prompt_id IN (SELECT prompt_id FROM {candidates})
    GROUP BY prompt_id, group_id
), ranked AS (
    SELECT *, row_number() OVER (PARTITION BY prompt_id ORDER BY step DESC, group_id DESC) AS r
    FROM groups_of
), window_of AS (
    SELECT prompt_id, count(*) AS groups_seen,
           coalesce(min(r) FILTER (WHERE NOT zero_variance), count(*) + 1) - 1 AS z,
           bool_or(all_correct) FILTER (WHERE r = 1) AS newest_all_correct
    FROM ranked
    WHERE r <= $skip_window
    GROUP BY prompt_id
)
SELECT prompt_id, groups_seen, z,
       CASE WHEN z = 0 THEN NULL WHEN newest_all_correct THEN 'all_correct' ELSE 'all_wrong' END AS kind
FROM window_of
