-- Audit (docs/schema.md `selections`): exactly one row per candidate, in rollout_id order; replayed,
-- age and uses say whether it came from the replay window, how old it is and how often it was used before.
SELECT
    $curation_id                                    AS curation_id,
    w.rollout_id, w.group_id, w.prompt_id, w.policy_version,
    w.group_size, w.group_accuracy, w.difficulty, w.advantage_raw, w.amplification,
    w.advantage_final, w.selected, w.reason, w.sample_rank, w.tokens_total,
    coalesce(c.tokens_kept, 0)::INTEGER             AS tokens_kept,
    w.replayed, w.age, w.uses
FROM work w
LEFT JOIN kept_counts c USING (rollout_id)
ORDER BY w.rollout_id;
