-- Token selection needs every selected row's entropies, finite: the first selected row (by
-- rollout_id) without them, or with a NaN or infinite one (DuckDB orders NaN above every number,
-- so list_max is NaN when any element is), if any, is the error the run stops with; the error
-- names the row's input shard (`filename`).
SELECT e.rollout_id, e.entropies IS NULL AS missing, w.filename
FROM selected_entropies e
JOIN work w USING (rollout_id)
WHERE e.entropies IS NULL OR NOT isfinite(list_max(e.entropies)) OR NOT isfinite(list_min(e.entropies))
ORDER BY e.rollout_id
LIMIT 1;
