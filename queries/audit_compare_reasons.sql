-- Two curations: candidates counted by (reason in A, reason in B); a null reason means the rollout
-- is not a candidate of that curation.
WITH a AS (
    SELECT rollout_id, reason FROM selections WHERE curation_id = $a
),
b AS (
    SELECT rollout_id, reason FROM selections WHERE curation_id = $b
)
SELECT
    a.reason                AS reason_a,
    b.reason                AS reason_b,
    count(*)                AS rollouts
FROM a FULL OUTER JOIN b USING (rollout_id)
GROUP BY ALL
ORDER BY rollouts DESC, reason_a NULLS LAST, reason_b NULLS LAST;
