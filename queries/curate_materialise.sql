-- Materialisation (docs/curation.md §Materialisation; schema `curated` as stored, CURATED_REFS,
-- without curation_id and with the row's input shard as a full path): for the selected rows of one
-- input shard ({rollouts}, read with `file_row_number`; the caller sorts them by rollout_id), a
-- reference to the rollouts row (`shard_file`, `rollouts_row`, rollout_id), advantage_final,
-- weight, the response length and the loss mask {loss_mask} as kept runs [start, end, start, end, ...] (end
-- exclusive): a token is kept when its (score desc, rollout_id asc, position asc) order is not after
-- the K-th token's ($thr, $thr_rollout, $thr_pos), computed from `selected_entropies` (no second
-- read of the entropies); with no token stage every token is kept. No token list is read or copied:
-- readers resolve the reference (storage/references.py); the engine adds `fallback` (no
-- old_logprobs) from the shards' column statistics (curate/output.py). Run over a few input shards at a time (as
-- many as the session has threads; one per Dask task): memory stays bounded by their selected rows.
WITH masked AS (
    SELECT
        r.rollout_id, r.group_id, r.prompt_id, r.policy_version,
        r.file_row_number                                 AS rollouts_row,
        w.advantage_final                                 AS advantage,
        w.weight,
        w.tokens_total                                    AS tokens,
        {loss_mask}                                       AS loss_mask,
        w.filename                                        AS shard_file
    FROM {rollouts} r
    JOIN (SELECT rollout_id, advantage_final, weight, tokens_total, filename FROM work WHERE selected) w
        USING (rollout_id)
    LEFT JOIN selected_entropies e USING (rollout_id)
)
SELECT
    * EXCLUDE (loss_mask),
    list_filter(range(len(loss_mask) + 1),
                lambda i: coalesce(loss_mask[i + 1], false) <> coalesce(loss_mask[i], false))::INTEGER[]
                                                          AS keep_runs
FROM masked;
