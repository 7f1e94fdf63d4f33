-- Two curations: the rollouts whose treatment differs: kept by one side only (`a_only`, `b_only`),
-- or kept by both with a different advantage or a different number of kept tokens (`both_differ`).
WITH a AS (
    SELECT * FROM selections WHERE curation_id = $a
),
b AS (
    SELECT * FROM selections WHERE curation_id = $b
),
joined AS (
    SELECT
        rollout_id,
        coalesce(a.group_id, b.group_id)            AS group_id,
        coalesce(a.prompt_id, b.prompt_id)          AS prompt_id,
        coalesce(a.group_accuracy, b.group_accuracy) AS group_accuracy,
        a.reason                                    AS reason_a,
        b.reason                                    AS reason_b,
        a.advantage_final                           AS advantage_a,
        b.advantage_final                           AS advantage_b,
        a.tokens_kept                               AS tokens_kept_a,
        b.tokens_kept                               AS tokens_kept_b,
        coalesce(a.tokens_total, b.tokens_total)    AS tokens_total,
        coalesce(a.selected, false)                 AS kept_a,
        coalesce(b.selected, false)                 AS kept_b
    FROM a FULL OUTER JOIN b USING (rollout_id)
)
SELECT
    CASE
        WHEN kept_a AND NOT kept_b THEN 'a_only'
        WHEN kept_b AND NOT kept_a THEN 'b_only'
        ELSE 'both_differ'
    END                                             AS kind,
    * EXCLUDE (kept_a, kept_b)
FROM joined
WHERE kept_a <> kept_b
   OR (kept_a AND kept_b AND (advantage_a IS DISTINCT FROM advantage_b OR tokens_kept_a <> tokens_kept_b))
ORDER BY kind, group_id, rollout_id;
