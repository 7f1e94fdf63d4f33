-- Report, accuracy and reward: sampled accuracy and reward by the policy version that sampled
-- them. accuracy = mean of `correct` over judged rollouts (null verdicts left out).
SELECT
    policy_version,
    count(*)                                 AS rollouts,
    count(DISTINCT group_id)                 AS groups,
    count(correct)                           AS judged,
    avg(correct::INTEGER)                    AS accuracy,
    avg(reward::DOUBLE)                      AS reward_mean,
    stddev_samp(reward::DOUBLE)              AS reward_std,
    avg(response_length)                     AS mean_response_tokens
FROM rollouts
GROUP BY policy_version
ORDER BY policy_version;
