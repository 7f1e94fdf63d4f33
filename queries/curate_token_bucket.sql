-- Token threshold, pass 2: the first $n tokens of one bucket in the threshold's order (score desc,
-- rollout_id asc, position asc). The K-th token of the batch is among the heads of its bucket.
-- The range test before `bucket = $bucket` only saves work: a token of bucket b has
-- 2^(b/64) ≤ score < 2^((b+1)/64), inside the range tested with one bucket of margin on each side
-- (the log2 of the key is off by far less than 1/64), so the range drops no token of the bucket,
-- and most tokens are dropped by two comparisons before their log2 is taken.
SELECT score, rollout_id, pos
FROM token_scores
WHERE (score = 0 OR score BETWEEN pow(2.0, ($bucket - 1) / 64.0) AND pow(2.0, ($bucket + 2) / 64.0))
  AND bucket = $bucket
ORDER BY score DESC, rollout_id ASC, pos ASC
LIMIT $n;
