-- Why candidates of one curation were kept or dropped ($rollout_ids: a list, one row each): the
-- reason; where the row stood in its sample-selection pool, ordered as curate_select.sql orders it
-- (value desc, rollout_id asc; the value is advantage_final, or the reward with sample=pods:
-- $by_reward); the pool's size and budget (rows selected from it); and which part of the order was
-- kept. The max-variance subset keeps the top `top_kept` rows of the order (ranks 1..top_kept) and
-- the bottom ones from rank `bottom_from` (to pool_size), and drops the middle: a row is kept when
-- its value is ≥ keep_at_or_above (the top block's last value) or ≤ keep_at_or_below (the bottom
-- block's first value); either is NULL when its block is empty. `side` says where the row fell:
-- 'top' or 'bottom' (kept), 'middle' (dropped), 'whole pool' (nothing dropped). A pool is the batch,
-- or the group with $by_group (in-group and PODS). Rows that never reached sample selection
-- (invalid, zero_variance, stale, ...) have no position. The text columns are read for the
-- requested rows only.
WITH s AS (
    SELECT
        s.*,
        CASE WHEN $by_reward THEN r.reward::DOUBLE ELSE s.advantage_final::DOUBLE END AS value,
        CASE WHEN $by_group THEN s.group_id ELSE 'batch' END                       AS pool
    FROM selections s
    LEFT JOIN (SELECT rollout_id, reward FROM rollouts WHERE $by_reward) r USING (rollout_id)
    WHERE s.curation_id = $curation_id
),
pooled AS (  -- the rows that reached sample selection
    SELECT
        rollout_id, pool, value, selected,
        row_number() OVER (PARTITION BY pool ORDER BY value DESC, rollout_id ASC) AS pool_position,
        count(*) OVER (PARTITION BY pool)                                          AS pool_size,
        count(*) FILTER (WHERE selected) OVER (PARTITION BY pool)                  AS budget
    FROM s
    WHERE reason IN ('selected', 'not_selected')
),
gaps AS (  -- the dropped middle of each pool's order
    SELECT pool,
           min(pool_position) FILTER (WHERE NOT selected) AS first_dropped,
           max(pool_position) FILTER (WHERE NOT selected) AS last_dropped
    FROM pooled
    GROUP BY pool
),
cutoffs AS (
    SELECT
        p.pool,
        any_value(g.first_dropped)                                          AS first_dropped,
        any_value(g.last_dropped)                                           AS last_dropped,
        max(p.value) FILTER (WHERE p.pool_position = g.first_dropped - 1) AS keep_at_or_above,
        min(p.value) FILTER (WHERE p.pool_position = g.last_dropped + 1)  AS keep_at_or_below
    FROM pooled p
    JOIN gaps g USING (pool)
    GROUP BY p.pool
)
SELECT
    s.rollout_id, s.reason, s.selected, s.value AS selection_value,
    p.pool_position, p.pool_size, p.budget,
    CASE WHEN p.pool IS NOT NULL THEN coalesce(c.first_dropped - 1, p.pool_size) END::BIGINT AS top_kept,
    CASE WHEN c.last_dropped < p.pool_size THEN c.last_dropped + 1 END::BIGINT             AS bottom_from,
    CASE
        WHEN p.pool IS NULL THEN NULL
        WHEN c.first_dropped IS NULL THEN 'whole pool'
        WHEN NOT s.selected THEN 'middle'
        WHEN p.pool_position < c.first_dropped THEN 'top'
        ELSE 'bottom'
    END AS side,
    c.keep_at_or_above, c.keep_at_or_below,
    s.sample_rank, s.advantage_raw, s.amplification, s.advantage_final, s.group_accuracy, s.difficulty,
    s.tokens_total, s.tokens_kept, s.replayed, s.age, s.uses,
    r.prompt, r.gold_answer, r.response, r.reward, r.correct
FROM s
LEFT JOIN pooled p USING (rollout_id)
LEFT JOIN cutoffs c ON c.pool = p.pool
JOIN (SELECT rollout_id, prompt, gold_answer, response, reward, correct FROM rollouts
      WHERE list_contains($rollout_ids, rollout_id)) r USING (rollout_id)
WHERE list_contains($rollout_ids, s.rollout_id)
ORDER BY s.rollout_id;
