-- Report, accuracy and reward: held-out evaluations (`rollstore loop` every --eval-every
-- iterations, `rollstore eval --buffer`), one row per measurement.
SELECT
    run_id,
    split,
    metric,
    policy_version,
    iteration,
    value,
    n_problems,
    n_samples,
    created_at
FROM evaluations
ORDER BY run_id, split, metric, policy_version, iteration, created_at;
