-- Sample selection, applied — record the sample stage's choice: pool rows in `picked` become 'selected' or
-- 'not_selected' with their sample_rank; rows that left earlier keep their reason.
CREATE OR REPLACE TEMP TABLE work AS
SELECT
    w.* EXCLUDE (reason, selected, sample_rank),
    CASE
        WHEN w.reason IS NOT NULL THEN w.reason
        WHEN p.selected THEN 'selected'
        ELSE 'not_selected'
    END                                             AS reason,
    coalesce(p.selected, false)                     AS selected,
    CASE WHEN p.selected THEN p.sample_rank END     AS sample_rank
FROM work w
LEFT JOIN picked p USING (rollout_id);
