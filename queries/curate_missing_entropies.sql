-- Token selection needs every selected row's entropies: the first selected row without them (by
-- rollout_id), if any, is the error the run stops with.
SELECT rollout_id
FROM selected_entropies
WHERE entropies IS NULL
ORDER BY rollout_id
LIMIT 1;
