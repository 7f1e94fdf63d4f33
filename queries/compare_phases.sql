-- `rollstore compare A B`: the loop's seconds per phase, summed over each run's checkpoints
-- (`checkpoints.metrics.phases`, written by `rollstore loop`; up to the optimiser of each iteration).
WITH entries AS (
    SELECT run_id, unnest(map_entries(from_json(json_extract(metrics, '$.phases'), '"MAP(VARCHAR, DOUBLE)"'))) AS e
    FROM checkpoints
    WHERE run_id IN ($a, $b) AND json_exists(metrics, '$.phases')
)
SELECT run_id, e.key AS phase, sum(e.value) AS seconds
FROM entries
GROUP BY ALL
ORDER BY phase, run_id;
