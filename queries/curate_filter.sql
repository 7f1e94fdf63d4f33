-- Group statistics, advantages and dynamic sampling applied to `work`: group statistics and advantages join back to each eligible row
-- (audit columns group_size, group_accuracy, advantage_raw), then the dynamic-sampling filter
-- (DAPO; docs/curation.md §Dynamic sampling): with $dynamic, groups with p ∈ {0, 1} — judged on `correct`, never on
-- the shaped reward — get 'zero_variance' and leave the pool.
CREATE OR REPLACE TEMP TABLE work AS
SELECT
    w.* EXCLUDE (reason),
    CASE
        WHEN w.reason IS NOT NULL THEN w.reason
        WHEN $dynamic AND (a.g_correct = 0 OR a.g_correct = a.g_size) THEN 'zero_variance'
    END AS reason,
    a.g_size                                        AS group_size,
    a.g_correct,
    (a.g_correct / a.g_size)::FLOAT                 AS group_accuracy,
    a.adv                                           AS advantage_raw
FROM work w
LEFT JOIN full_adv a USING (rollout_id);
