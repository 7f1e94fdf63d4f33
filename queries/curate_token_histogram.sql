-- Token threshold, pass 1: tokens per score bucket, highest bucket first. Counts add exactly, so
-- per-shard histograms summed give the batch's. Reads `token_buckets` (the key alone).
SELECT bucket, count(*) AS n
FROM token_buckets
GROUP BY bucket
ORDER BY bucket DESC;
