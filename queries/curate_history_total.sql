-- Amplification input — the difficulty history per prompt, totalled: the sum of the partial
-- per-prompt counts of curate_history.sql (one part in one session; one per input shard on Dask,
-- where a partition holds every part of its prompts). Integer sums, so the total is exact.
CREATE OR REPLACE TEMP TABLE prompt_history AS
SELECT prompt_id, sum(n)::BIGINT AS n, sum(k)::BIGINT AS k
FROM history_parts
GROUP BY prompt_id;
