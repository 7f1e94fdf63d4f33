-- Group statistics, advantages and dynamic sampling applied to `work`: group statistics and advantages join back to each eligible row
-- (audit columns group_size, group_accuracy, advantage_raw), then the dynamic-sampling filter
-- (DAPO; docs/curation.md §Dynamic sampling): with $dynamic, groups with p ∈ {0, 1} — judged on `correct`, never on
-- the shaped reward — get 'zero_variance' and leave the pool. Rows with an eligibility reason get no
-- statistics, even where their group's were computed with them (a replayed row at its use cap).
CREATE OR REPLACE TEMP TABLE work AS
SELECT
    w.* EXCLUDE (reason),
    CASE
        WHEN w.reason IS NOT NULL THEN w.reason
        WHEN $dynamic AND (a.g_correct = 0 OR a.g_correct = a.g_size) THEN 'zero_variance'
    END AS reason,
    CASE WHEN w.reason IS NULL THEN a.g_size END                            AS group_size,
    CASE WHEN w.reason IS NULL THEN a.g_correct END                         AS g_correct,
    CASE WHEN w.reason IS NULL THEN (a.g_correct / a.g_size)::FLOAT END     AS group_accuracy,
    CASE WHEN w.reason IS NULL THEN a.adv END                               AS advantage_raw
FROM work w
LEFT JOIN full_adv a USING (rollout_id);
