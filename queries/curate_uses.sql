-- Uses (docs/replay.md §Uses): each candidate's `uses` = the distinct committed curations that
-- selected it before, and the reason `reused` for an eligible row selected $max_reuse times (when
-- set), or $replay_max_uses times with replay (the last reason of curate_candidates.sql's order).
-- {selections} is what the engine binds: the audit shards of the snapshot's committed curations
-- (their manifest keys) whose rollout_id range, read from the shard's footer, meets the range of
-- `work` — in a loop, none but the replay window's: the step is skipped when no shard is left (an
-- audit of every past curation cost ~0.5 ms of this statement each).
UPDATE work SET
    uses = u.n,
    reason = CASE
        WHEN work.reason IS NOT NULL THEN work.reason
        WHEN $max_reuse IS NOT NULL AND u.n >= $max_reuse THEN 'reused'
        WHEN $replay_on AND u.n >= $replay_max_uses THEN 'reused'
    END
FROM (
    SELECT rollout_id, count(DISTINCT curation_id)::INTEGER AS n
    FROM {selections}
    WHERE selected
    GROUP BY rollout_id
) u
WHERE work.rollout_id = u.rollout_id;
