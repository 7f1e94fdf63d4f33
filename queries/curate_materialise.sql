-- Materialisation (docs/curation.md §Materialisation; schema `curated` without curation_id): the
-- learner's rows for the selected rows of one input shard ({rollouts}; the caller sorts them by
-- rollout_id): token ids, trainer log-probs (falling back to the sampler's when absent, flagged in
-- `fallback`), advantage_final, weight and the loss mask {loss_mask}: a token is kept when its
-- (score desc, rollout_id asc, position asc) order is not after the K-th token's ($thr,
-- $thr_rollout, $thr_pos), computed from `selected_entropies` (no second read of the entropies);
-- with no token stage every token is kept. `shard_file` (the row's input shard) lets the engine put
-- the rows of several shards back under their shard. Run over a few input shards at a time (as many as the
-- session has threads, within 256 MiB; one per Dask task): memory stays bounded by their selected rows.
SELECT
    r.rollout_id, r.group_id, r.prompt_id, r.policy_version,
    r.prompt_token_ids, r.response_token_ids, r.gen_logprobs,
    r.old_logprobs IS NULL                                AS fallback,
    coalesce(r.old_logprobs, r.gen_logprobs)              AS old_logprobs,
    w.advantage_final                                     AS advantage,
    w.weight,
    {loss_mask}                                           AS loss_mask,
    w.filename                                            AS shard_file
FROM {rollouts} r
JOIN (SELECT rollout_id, advantage_final, weight, filename FROM work WHERE selected) w USING (rollout_id)
LEFT JOIN selected_entropies e USING (rollout_id);
