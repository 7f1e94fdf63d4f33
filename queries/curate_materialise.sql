-- Materialisation (docs/curation.md §Materialisation; schema `curated` as stored, CURATED_REFS,
-- without curation_id and with the row's input shard as a full path): the selected rows of the
-- input shards $shards, each with a reference to its rollouts row (`shard_file`, `rollouts_row` as
-- the candidates' scan read it, rollout_id), advantage_final, weight and the response length, all
-- from `work`: this query reads no Parquet. `entropies` is a null placeholder: with a token stage
-- the kernel step `entropies` reads each row's entropies from its shard at its position (only that
-- column, only the row groups holding a selected row). The engine sorts the rows (input shard,
-- rollout_id), turns the entropies into the loss mask as kept runs (curate/tokens.py `keep_runs`,
-- the predicate of the kernel tokens_kept; their total is checked against the audit's) and adds
-- `fallback` (no old_logprobs) from the shards' column statistics; no token list is written. Run
-- for a few input shards at a time (one per Dask task): memory stays bounded by their selected
-- rows' entropies.
SELECT
    w.rollout_id, w.group_id, w.prompt_id, w.policy_version, w.rollouts_row,
    w.advantage_final                                 AS advantage,
    w.weight,
    w.tokens_total                                    AS tokens,
    NULL::FLOAT[]                                     AS entropies,
    w.filename                                        AS shard_file
FROM work w
WHERE w.selected AND list_contains($shards, w.filename);
