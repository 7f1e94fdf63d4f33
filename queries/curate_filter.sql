-- Group statistics, advantages and dynamic sampling applied to `work` (updated in place): the
-- eligible rows get their group's statistics and advantage (audit columns group_size,
-- group_accuracy, advantage_raw), then the dynamic-sampling filter (DAPO; docs/curation.md
-- §Dynamic sampling): with $dynamic, groups with p ∈ {0, 1} — judged on `correct`, never on the
-- shaped reward — get 'zero_variance' and leave the pool. Rows with an eligibility reason get no
-- statistics, even where their group's were computed with them (a replayed row at its use cap).
-- Every row given statistics starts unamplified (amplification 1, advantage_final = its advantage):
-- exactly what curate_amplify.sql sets when nothing is amplified, so a plan without amplification
-- (amplify=none, no PODS) has no amplify step.
UPDATE work SET
    reason         = CASE WHEN $dynamic AND (a.g_correct = 0 OR a.g_correct = a.g_size) THEN 'zero_variance' END,
    group_size     = a.g_size,
    g_correct      = a.g_correct,
    group_accuracy = (a.g_correct / a.g_size)::FLOAT,
    advantage_raw  = a.adv,
    amplification  = 1.0::FLOAT,
    advantage_final = a.adv
FROM full_adv a
WHERE work.rollout_id = a.rollout_id AND work.reason IS NULL;
