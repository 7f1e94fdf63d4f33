-- Tokens kept per selected row (the audit's tokens_kept, the record's tokens_kept): the true
-- entries of the same {loss_mask} expression that curate_materialise.sql writes, computed from
-- `selected_entropies` (with no token stage, every response token: the row's tokens_total).
CREATE OR REPLACE TEMP TABLE kept_counts AS
SELECT w.rollout_id, ({kept})::INTEGER AS tokens_kept
FROM work w
LEFT JOIN selected_entropies e USING (rollout_id)
WHERE w.selected;
