-- Why one candidate of one curation was kept or dropped: its reason; where it stood in its sample
-- selection pool, ordered as curate_select.sql orders it (value desc, rollout_id asc; the value is
-- advantage_final, or the reward with sample=pods: $by_reward); the pool's size and budget (rows
-- selected from it); and the two cut-offs of the max-variance subset: the selected rows are the
-- top j of the order and the bottom m − j, so a row was kept when its value is ≥ keep_at_or_above
-- (the j-th value) or ≤ keep_at_or_below (the first value of the bottom block); either is NULL
-- when its block is empty. A pool is the batch, or the group with $by_group (in-group and PODS).
-- Rows that never reached sample selection (invalid, zero_variance, stale, ...) have no position.
WITH s AS (
    SELECT
        s.*, r.prompt, r.gold_answer, r.response, r.reward, r.correct,
        CASE WHEN $by_reward THEN r.reward::DOUBLE ELSE s.advantage_final::DOUBLE END AS value,
        CASE WHEN $by_group THEN s.group_id ELSE 'batch' END                       AS pool
    FROM selections s
    JOIN rollouts r USING (rollout_id)
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
        max(p.value) FILTER (WHERE p.pool_position = g.first_dropped - 1) AS keep_at_or_above,
        min(p.value) FILTER (WHERE p.pool_position = g.last_dropped + 1)  AS keep_at_or_below
    FROM pooled p
    JOIN gaps g USING (pool)
    GROUP BY p.pool
)
SELECT
    s.rollout_id, s.reason, s.selected, s.value AS selection_value,
    p.pool_position, p.pool_size, p.budget, c.keep_at_or_above, c.keep_at_or_below,
    s.sample_rank, s.advantage_raw, s.amplification, s.advantage_final, s.group_accuracy, s.difficulty,
    s.tokens_total, s.tokens_kept, s.replayed, s.age, s.uses,
    s.prompt, s.gold_answer, s.response, s.reward, s.correct
FROM s
LEFT JOIN pooled p USING (rollout_id)
LEFT JOIN cutoffs c ON c.pool = p.pool
WHERE s.rollout_id = $rollout_id;
