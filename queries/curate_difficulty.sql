-- Amplification — difficulty q̂ per group (docs/curation.md §Amplification): pooled accuracy of the judged
-- attempts at the group's prompt within the last $window policy versions (`prompt_history`, from
-- curate_history.sql), plus the group's own rows that reached step 2 (counted once, even below the
-- window), smoothed by a Beta prior centred on $mu (accuracy of the batch's eligible rows,
-- curate_batch_accuracy.sql) with strength $prior:  q̂ = (Σk + s·μ) / (Σn + s).
-- A group's rows share one policy_version, and the rows that reached step 2 are judged, so they
-- are either all inside the window (already counted) or all outside it (added once).
CREATE OR REPLACE TEMP TABLE difficulty AS
WITH reached AS (
    SELECT group_id, prompt_id, policy_version, correct FROM work WHERE group_size IS NOT NULL
),
own_outside AS (  -- a group's own rows when its version is outside the window
    SELECT group_id, any_value(prompt_id) AS prompt_id,
           count(*) FILTER (WHERE policy_version NOT BETWEEN $current_version - $window + 1 AND $current_version) AS n,
           count(*) FILTER (WHERE correct AND policy_version NOT BETWEEN $current_version - $window + 1 AND $current_version) AS k
    FROM reached
    GROUP BY group_id
)
SELECT
    o.group_id,
    coalesce(h.n, 0) + o.n                          AS n_hist,
    coalesce(h.k, 0) + o.k                          AS k_hist,
    CASE WHEN coalesce(h.n, 0) + o.n + $prior = 0 THEN NULL
         ELSE (coalesce(h.k, 0) + o.k + $prior * $mu) / (coalesce(h.n, 0) + o.n + $prior)
    END                                             AS q_hat
FROM own_outside o
LEFT JOIN prompt_history h USING (prompt_id);
