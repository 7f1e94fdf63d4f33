-- Report, accuracy and reward: the same by generation step of each run (a step may span several
-- policy versions when generation ran ahead of the learner).
SELECT
    run_id,
    step,
    min(policy_version)                      AS min_policy_version,
    max(policy_version)                      AS max_policy_version,
    count(*)                                 AS rollouts,
    count(correct)                           AS judged,
    avg(correct::INTEGER)                    AS accuracy,
    avg(reward::DOUBLE)                      AS reward_mean,
    avg(response_length)                     AS mean_response_tokens
FROM rollouts
GROUP BY run_id, step
ORDER BY run_id, step;
