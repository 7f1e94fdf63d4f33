-- Sample selection, applied (to `work`, in place) — the sample stage's choice: pool rows in
-- `picked` become 'selected' or 'not_selected' with their sample_rank; rows that left earlier keep
-- their reason (and `selected` false, as created).
UPDATE work SET
    reason      = CASE WHEN p.selected THEN 'selected' ELSE 'not_selected' END,
    selected    = coalesce(p.selected, false),
    sample_rank = CASE WHEN p.selected THEN p.sample_rank END
FROM picked p
WHERE work.rollout_id = p.rollout_id AND work.reason IS NULL;
