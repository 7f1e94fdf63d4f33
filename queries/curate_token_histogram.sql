-- Token threshold, pass 1: tokens per score bucket, highest bucket first. Counts add exactly, so
-- per-shard histograms summed give the batch's.
SELECT bucket, count(*) AS n
FROM token_scores
GROUP BY bucket
ORDER BY bucket DESC;
