-- The default current_version when no checkpoint exists: the newest policy_version sampled.
SELECT max(policy_version) AS version
FROM {rollouts};
