-- Report, accuracy and reward: sampled accuracy and reward of each run by the policy version that
-- sampled them (`run_version`: the run's n-th version, views.sql `run_versions`). accuracy = mean of
-- `correct` over judged rollouts (null verdicts left out).
SELECT
    r.run_id,
    r.policy_version,
    any_value(v.run_version)                 AS run_version,
    count(*)                                 AS rollouts,
    count(DISTINCT r.group_id)               AS groups,
    count(r.correct)                         AS judged,
    avg(r.correct::INTEGER)                  AS accuracy,
    avg(r.reward::DOUBLE)                    AS reward_mean,
    stddev_samp(r.reward::DOUBLE)            AS reward_std,
    avg(r.response_length)                   AS mean_response_tokens
FROM rollouts AS r
LEFT JOIN run_versions AS v USING (run_id, policy_version)
GROUP BY r.run_id, r.policy_version
ORDER BY r.run_id, r.policy_version;
