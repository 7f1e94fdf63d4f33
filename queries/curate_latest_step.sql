-- The default batch (docs/curation.md §Parameters, `where`): the latest step of the latest run, by
-- creation time. Per shard, the maximum over shards' answers is the snapshot's.
SELECT created_at, run_id, step
FROM {rollouts}
ORDER BY created_at DESC, run_id DESC, step DESC
LIMIT 1;
