-- `rollstore compare A B`: each run's held-out evaluations against its own versions
-- (`run_version`: views.sql `run_versions`), one row per (run, split, metric, version).
SELECT
    e.run_id,
    e.split,
    e.metric,
    v.run_version,
    e.policy_version,
    avg(e.value) AS value
FROM evaluations AS e
JOIN run_versions AS v USING (run_id, policy_version)
WHERE e.run_id IN ($a, $b)
GROUP BY ALL
ORDER BY e.split, e.metric, v.run_version, e.run_id;
