-- Eligibility input check (docs/integrity.md §Non-finite numbers): the first candidate (by
-- rollout_id) whose reward is NaN or infinite, if any, is the error the run stops with. Import
-- refuses such rows; this catches a shard that reached the manifest another way.
SELECT rollout_id, filename, reward::DOUBLE AS reward
FROM work
WHERE NOT isfinite(reward)
ORDER BY rollout_id
LIMIT 1;
