-- The smallest and largest rollout_id of this session's `work` (NULLs when empty): what the engine
-- narrows the uses step's audit shards to (curate.steps.Audits), by their footers' statistics.
SELECT min(rollout_id), max(rollout_id) FROM work;
