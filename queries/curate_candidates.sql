-- Eligibility (docs/curation.md §Eligibility). The batch is every snapshot row matched by the
-- `where` predicate; each candidate gets the first reason that applies, in this order: invalid,
-- truncated, stale, reused (`reused` is set by curate_uses.sql). NULL reason = eligible. Per-token arrays stay in the rollouts shards;
-- `work` holds one narrow row per candidate, with the shard (`filename`) it lives in and its
-- position there (`rollouts_row`, DuckDB's `file_row_number`): what a curated row refers to, so
-- materialisation reads no Parquet, and the token stage opens only the shards with a selected row.
-- `tokens_total` is the stored `response_length` (schema version 3; computed by the relation for
-- older shards): the scan decodes no token list.
-- Replay (docs/replay.md): with {window} not `false`, the batch also holds the replay window — rows
-- of the batch's own run sampled 1..$replay_window policy versions before $current_version and not
-- matched by `where` (`replayed`); a row already selected $replay_max_uses times is `reused`.
-- `age` = current_version − policy_version; `uses` (committed curations that selected it before) is
-- 0 until curate_uses.sql counts them.
-- `has_behaviour`: the row carries its sampling policy's log-probs ({behaviour}; always true without replay).
-- `work` is created here with every column a later step sets (NULL, false or 1 until then): the later
-- steps UPDATE the columns they decide and never rewrite the table (a rewrite of `work` cost 20-40 ms
-- at 43k rows, nearly all in DuckDB's table sink). Its rows are in rollout_id order, and so are the
-- tables the updates join (`full_adv`, `picked`, ...): an UPDATE that meets its rows out of order
-- cost 5-6× one that meets them in order (90 against 16 ms at 43k rows).
CREATE OR REPLACE TEMP TABLE work AS
WITH batch AS (
    SELECT rollout_id, group_id, prompt_id, run_id, policy_version, reward, correct, verify_error,
           finish_reason, response_length AS tokens_total, filename, file_row_number AS rollouts_row,
           NOT coalesce(({where}), false) AS replayed,
           ({behaviour}) AS has_behaviour
    FROM {rollouts} AS rollouts
    WHERE ({where}) OR ({window})
)
SELECT
    -- verify_error and finish_reason are read for `reason` only
    b.* EXCLUDE (verify_error, finish_reason),
    CASE
        WHEN b.correct IS NULL OR b.verify_error IS NOT NULL THEN 'invalid'
        WHEN $drop_truncated AND b.finish_reason IN ('length', 'abort') THEN 'truncated'
        WHEN $max_policy_lag IS NOT NULL
             AND b.policy_version < $current_version - $max_policy_lag THEN 'stale'
    END AS reason,
    ($current_version - b.policy_version)::BIGINT AS age,
    0::INTEGER AS uses,
    false AS replay_dropped,  -- set by curate_replay_apply.sql: a window row replay did not choose
    false AS selected,                      -- set by the apply step (curate_apply_selection.sql, ...)
    NULL::INTEGER AS sample_rank,
    1.0::FLOAT    AS weight,
    NULL::INTEGER AS group_size,            -- curate_filter.sql: the group statistics of a row in the pool
    NULL::INTEGER AS g_correct,
    NULL::FLOAT   AS group_accuracy,
    NULL::FLOAT   AS advantage_raw,
    NULL::FLOAT   AS difficulty,            -- curate_amplify.sql
    NULL::FLOAT   AS amplification,
    NULL::FLOAT   AS advantage_final
FROM batch b
ORDER BY b.rollout_id;
