-- Materialisation (docs/curation.md §Materialisation; schema `curated` as stored, CURATED_REFS,
-- without curation_id and with the row's input shard as a full path): for the selected rows of one
-- input shard ({rollouts}, read with `file_row_number`; the caller sorts them by rollout_id), a
-- reference to the rollouts row (`shard_file`, `rollouts_row`, rollout_id), advantage_final,
-- weight, the response length, the tokens kept (`kept_counts`) and the row's entropies from
-- `selected_entropies` (no second read of Parquet; null without a token stage). The engine turns
-- the entropies into the loss mask as kept runs (curate/tokens.py `keep_runs`, the predicate of
-- curate_tokens_kept.sql, checked against `tokens_kept`) and adds `fallback` (no old_logprobs) from
-- the shards' column statistics; no token list is written. Run over a few input shards at a time (as
-- many as the session has threads; one per Dask task): memory stays bounded by their selected rows.
SELECT
    r.rollout_id, r.group_id, r.prompt_id, r.policy_version,
    r.file_row_number                                 AS rollouts_row,
    w.advantage_final                                 AS advantage,
    w.weight,
    w.tokens_total                                    AS tokens,
    c.tokens_kept,
    e.entropies,
    w.filename                                        AS shard_file
FROM {rollouts} r
JOIN (SELECT rollout_id, advantage_final, weight, tokens_total, filename FROM work WHERE selected) w
    USING (rollout_id)
JOIN kept_counts c USING (rollout_id)
LEFT JOIN selected_entropies e USING (rollout_id);
