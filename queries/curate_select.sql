-- Sample selection — maximum-variance subsets (PODS arXiv 2504.13818; D3S arXiv 2509.22115).
-- Pools: rows still eligible (reason NULL), one pool per {pool_key} (a group: sample=in_group and
-- pods; the plan runs the one-pool case, sample=cross_group, as the kernel max_variance,
-- curate/selection.py, which computes the same from the same definition).
-- Budget per pool of n rows: m = min(n, max(2, ⌊n·f + ½⌋)), f = $f_num / $f_den exactly.
-- Order each pool by (v desc, rollout_id asc); S_j = first j rows ∪ last m − j rows, j = 0..m.
-- Some S_j is optimal for any multiset of reals, so prefix sums over the sorted pool give every
-- Var(S_j) exactly (population variance; values centred on the pool mean for accuracy).
-- Ties: every j with Var(S_j) ≥ V*·(1 − 1e-9) − 1e-12; then smallest |2j − m|, then smaller j.
-- Output `picked`: one row per pool row with `selected` and its 1-based `sample_rank` among the
-- selected rows of the pool in that order.
CREATE OR REPLACE TEMP TABLE picked AS
WITH pool AS (
    SELECT rollout_id, {pool_key} AS pool, ({value})::DOUBLE AS v
    FROM work
    WHERE reason IS NULL
),
ranked AS (
    SELECT
        rollout_id, pool, v,
        row_number() OVER (PARTITION BY pool ORDER BY v DESC, rollout_id ASC) AS pos,
        count(*) OVER (PARTITION BY pool)                                      AS n,
        v - avg(v) OVER (PARTITION BY pool)                                    AS c
    FROM pool
),
sizes AS (
    SELECT pool, any_value(n) AS n,
           least(any_value(n), greatest(2, (2 * any_value(n)::HUGEINT * $f_num + $f_den) // (2 * $f_den)))::BIGINT AS m
    FROM ranked
    GROUP BY pool
),
prefix AS (  -- running sums of the centred values; pos 0 is the empty prefix
    SELECT pool, pos,
           sum(c) OVER w     AS s1,
           sum(c * c) OVER w AS s2
    FROM ranked
    WINDOW w AS (PARTITION BY pool ORDER BY pos ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
    UNION ALL
    SELECT pool, 0, 0.0, 0.0 FROM sizes
),
splits AS (
    SELECT s.pool, s.n, s.m, j.j
    FROM sizes s, unnest(range(0, s.m + 1)) AS j(j)
),
variances AS (  -- S_j sums = prefix(j) + (prefix(n) − prefix(n − (m − j)))
    SELECT
        sp.pool, sp.n, sp.m, sp.j,
        (top.s2 + tot.s2 - cut.s2) / sp.m - pow((top.s1 + tot.s1 - cut.s1) / sp.m, 2) AS var
    FROM splits sp
    JOIN prefix top ON top.pool = sp.pool AND top.pos = sp.j
    JOIN prefix cut ON cut.pool = sp.pool AND cut.pos = sp.n - (sp.m - sp.j)
    JOIN prefix tot ON tot.pool = sp.pool AND tot.pos = sp.n
),
best AS (
    SELECT pool, n, m, j
    FROM (
        SELECT v.*, max(var) OVER (PARTITION BY pool) AS v_star FROM variances v
    )
    WHERE var >= v_star * (1 - 1e-9) - 1e-12
    QUALIFY row_number() OVER (PARTITION BY pool ORDER BY abs(2 * j - m), j) = 1
)
SELECT
    r.rollout_id,
    (r.pos <= b.j OR r.pos > b.n - (b.m - b.j))                   AS selected,
    CASE WHEN r.pos <= b.j THEN r.pos
         WHEN r.pos > b.n - (b.m - b.j) THEN r.pos - (b.n - b.m)
    END::INTEGER                                                  AS sample_rank
FROM ranked r
JOIN best b USING (pool)
ORDER BY r.rollout_id;  -- the order of `work`: curate_apply_selection.sql updates it in place
