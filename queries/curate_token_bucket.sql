-- Token threshold, pass 2: the first $n tokens of one bucket in the threshold's order (score desc,
-- rollout_id asc, position asc). The K-th token of the batch is among the heads of its bucket.
SELECT score, rollout_id, pos
FROM token_scores
WHERE bucket = $bucket
ORDER BY score DESC, rollout_id ASC, pos ASC
LIMIT $n;
