-- One rollout in one curation: each response token with its entropy, its |A|·H score (from the
-- audit's advantage_final) and whether the curated loss mask kept it.
WITH s AS (
    SELECT * FROM selections WHERE curation_id = $curation_id AND rollout_id = $rollout_id
),
c AS (
    SELECT rollout_id, loss_mask FROM curated WHERE curation_id = $curation_id AND rollout_id = $rollout_id
),
tokens AS (
    SELECT
        unnest(range(1, len(r.response_token_ids) + 1))  AS pos,
        unnest(r.response_token_ids)                      AS token_id,
        unnest(coalesce(r.entropies, list_transform(r.response_token_ids, lambda t: NULL::FLOAT))) AS entropy,
        unnest(coalesce(c.loss_mask, list_transform(r.response_token_ids, lambda t: false)))     AS kept,
        s.advantage_final
    FROM rollouts r
    JOIN s USING (rollout_id)
    LEFT JOIN c USING (rollout_id)
)
SELECT pos, token_id, entropy, abs(advantage_final::DOUBLE) * entropy::DOUBLE AS score, kept
FROM tokens
ORDER BY pos;
