-- Report, accuracy and reward: held-out evaluations (`rollstore loop` every --eval-every
-- iterations, `rollstore eval --buffer`), one row per measurement; `run_version`: the run's n-th
-- version (views.sql `run_versions`).
SELECT
    e.run_id,
    e.split,
    e.metric,
    e.policy_version,
    v.run_version,
    e.iteration,
    e.value,
    e.n_problems,
    e.n_samples,
    e.created_at
FROM evaluations AS e
LEFT JOIN run_versions AS v USING (run_id, policy_version)
ORDER BY e.run_id, e.split, e.metric, e.policy_version, e.iteration, e.created_at;
