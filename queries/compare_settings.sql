-- `rollstore compare A B`: each run's settings: the loop's (`checkpoints.metrics.settings` of its
-- newest checkpoint) and the recipe and parameters of the newest curation it trained on
-- (`checkpoints.consumed` → `curations`).
WITH newest AS (
    SELECT run_id, arg_max(metrics, version) AS metrics, arg_max(consumed, version) AS consumed
    FROM checkpoints WHERE run_id IN ($a, $b) GROUP BY run_id
)
SELECT
    n.run_id,
    json_extract(n.metrics, '$.settings')::VARCHAR AS settings,
    c.recipe,
    c.params
FROM newest AS n
LEFT JOIN curations AS c ON c.curation_id = json_extract_string(n.consumed, '$[0].curation_id')
ORDER BY n.run_id;
