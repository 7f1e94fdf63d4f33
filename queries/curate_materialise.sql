-- Step 8b + materialisation — the learner's rows (schema.md `curated`, without curation_id) for
-- the selected rows of one input shard (`shard_rows`; the caller sorts them by rollout_id): token ids, trainer
-- log-probs (falling back to the sampler's when absent, flagged in `fallback`), advantage_final,
-- weight and the loss mask. A token is kept when its (score desc, rollout_id asc, position asc)
-- order is not after the K-th token's ($thr, $thr_rollout, $thr_pos); with no token stage every
-- token is kept. Run once per input shard so memory stays bounded by one shard.
WITH rows AS (
    SELECT
        r.rollout_id, r.group_id, r.prompt_id, r.policy_version,
        r.prompt_token_ids, r.response_token_ids, r.gen_logprobs,
        r.old_logprobs IS NULL                                AS fallback,
        coalesce(r.old_logprobs, r.gen_logprobs)              AS old_logprobs,
        w.advantage_final                                     AS advantage,
        w.weight,
        CASE WHEN $token_stage THEN
            list_transform(r.entropies, lambda h, i:
                ({score}) > $thr
                OR (({score}) = $thr AND (r.rollout_id < $thr_rollout
                                          OR (r.rollout_id = $thr_rollout AND i <= $thr_pos))))
        ELSE list_transform(r.response_token_ids, lambda t: true)
        END                                                   AS loss_mask
    FROM shard_rows r
    JOIN (SELECT rollout_id, advantage_final, weight FROM work WHERE selected) w USING (rollout_id)
)
SELECT
    rows.*,
    len(list_filter(loss_mask, lambda k: k))::INTEGER         AS tokens_kept
FROM rows;
