-- `rollstore audit A --compare B` (docs/audit.md): how a curation was trained — the checkpoint that
-- consumed it (its run, version and, when `rollstore loop` trained it, the loop's settings: μ, lr,
-- loss, batch, pool) and its optimiser steps in `training`. No row: it was never trained.
SELECT
    ck.run_id,
    ck.version,
    json_extract(ck.metrics, '$.settings')::VARCHAR AS settings,
    (SELECT count(*) FROM training AS t WHERE t.curation_id = $c) AS optimiser_steps,
    (SELECT max(t.lr) FROM training AS t WHERE t.curation_id = $c) AS lr_reached
FROM checkpoints AS ck
WHERE list_contains(json_extract_string(ck.consumed, '$[*].curation_id'), $c)
ORDER BY ck.version
LIMIT 1;
