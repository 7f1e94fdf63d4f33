-- Token selection needs every selected row's entropies, finite: the first selected row (by
-- rollout_id) without them, or with a NaN or infinite one (DuckDB orders NaN above every number,
-- so list_max is NaN when any element is), if any, is the error the run stops with.
SELECT rollout_id, entropies IS NULL AS missing
FROM selected_entropies
WHERE entropies IS NULL OR NOT isfinite(list_max(entropies)) OR NOT isfinite(list_min(entropies))
ORDER BY rollout_id
LIMIT 1;
