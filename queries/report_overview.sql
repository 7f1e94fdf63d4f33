-- Report, header: what the buffer holds at this snapshot (one row).
SELECT
    (SELECT count(*) FROM rollouts)                              AS rollouts,
    (SELECT count(DISTINCT group_id) FROM rollouts)              AS groups,
    (SELECT count(DISTINCT prompt_id) FROM rollouts)             AS prompts,
    (SELECT sum(response_length)::BIGINT FROM rollouts)           AS response_tokens,
    (SELECT count(DISTINCT run_id) FROM rollouts)                AS runs,
    (SELECT min(policy_version) FROM rollouts)                   AS first_policy_version,
    (SELECT max(policy_version) FROM rollouts)                   AS last_policy_version,
    (SELECT count(*) FROM curations)                             AS curations,
    (SELECT count(*) FROM checkpoints)                           AS checkpoints,
    (SELECT count(*) FROM training)                              AS training_steps,
    (SELECT count(*) FROM evaluations)                           AS evaluations;
