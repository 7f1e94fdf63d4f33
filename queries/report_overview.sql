-- Report, header: what the buffer holds at this snapshot (one row). The rollouts are scanned once.
WITH r AS (
    SELECT
        count(*)                                 AS rollouts,
        count(DISTINCT group_id)                 AS groups,
        count(DISTINCT prompt_id)                AS prompts,
        sum(response_length)::BIGINT             AS response_tokens,
        count(DISTINCT run_id)                   AS runs,
        min(policy_version)                      AS first_policy_version,
        max(policy_version)                      AS last_policy_version
    FROM rollouts
)
SELECT
    r.*,
    (SELECT count(*) FROM curations)                             AS curations,
    (SELECT count(*) FROM checkpoints)                           AS checkpoints,
    (SELECT count(*) FROM training)                              AS training_steps,
    (SELECT count(*) FROM evaluations)                           AS evaluations
FROM r;
