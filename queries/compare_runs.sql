-- `rollstore compare A B` (docs/audit.md §Comparing runs): what each run generated and trained.
-- `learner_tokens`: kept tokens summed over the run's optimiser steps (μ passes count μ times);
-- `loop_seconds`: the loop's phases summed over its checkpoints (`metrics.phases`, up to the optimiser).
WITH runs AS (
    SELECT unnest([$a, $b]) AS run_id, unnest([0, 1]) AS side
), gen AS (
    SELECT run_id, count(*) AS rollouts, count(DISTINCT step) AS steps, count(DISTINCT group_id) AS groups,
           sum(response_length) AS response_tokens, avg(correct::INTEGER) AS sampled_accuracy
    FROM rollouts WHERE run_id IN ($a, $b) GROUP BY run_id
), tr AS (
    SELECT run_id, count(*) AS optimiser_steps, sum(tokens) AS learner_tokens, sum(samples) AS learner_samples
    FROM training WHERE run_id IN ($a, $b) GROUP BY run_id
), ck AS (
    SELECT run_id, count(*) AS checkpoints, min(version) AS first_version, max(version) AS last_version
    FROM checkpoints WHERE run_id IN ($a, $b) GROUP BY run_id
)
SELECT
    runs.run_id,
    coalesce(gen.rollouts, 0)           AS rollouts,
    coalesce(gen.steps, 0)              AS steps,
    coalesce(gen.groups, 0)             AS groups,
    coalesce(gen.response_tokens, 0)    AS response_tokens,
    gen.sampled_accuracy,
    coalesce(tr.optimiser_steps, 0)     AS optimiser_steps,
    coalesce(tr.learner_tokens, 0)      AS learner_tokens,
    coalesce(tr.learner_samples, 0)     AS learner_samples,
    coalesce(ck.checkpoints, 0)         AS checkpoints,
    ck.first_version,
    ck.last_version
FROM runs
LEFT JOIN gen USING (run_id)
LEFT JOIN tr USING (run_id)
LEFT JOIN ck USING (run_id)
ORDER BY runs.side;
