-- Two curations side by side ("what-if" runs of different recipes on one snapshot): each one's record
-- and how their selections overlap, one row per side (A = $a, B = $b). Candidates are matched by
-- rollout_id; `kept_only_here` counts rollouts this side selected and the other did not (including
-- rollouts that are not candidates of the other side).
WITH a AS (
    SELECT rollout_id, selected FROM selections WHERE curation_id = $a
),
b AS (
    SELECT rollout_id, selected FROM selections WHERE curation_id = $b
),
joined AS (
    SELECT
        a.rollout_id IS NOT NULL AND b.rollout_id IS NOT NULL AS common,
        coalesce(a.selected, false)                           AS kept_a,
        coalesce(b.selected, false)                           AS kept_b
    FROM a FULL OUTER JOIN b USING (rollout_id)
),
overlap AS (
    SELECT
        count(*) FILTER (WHERE common)                        AS common_candidates,
        count(*) FILTER (WHERE kept_a AND kept_b)             AS kept_by_both,
        count(*) FILTER (WHERE kept_a AND NOT kept_b)         AS kept_by_a_only,
        count(*) FILTER (WHERE kept_b AND NOT kept_a)         AS kept_by_b_only
    FROM joined
)
SELECT
    s.side,
    c.curation_id,
    c.recipe,
    c.snapshot_seq,
    c.progress,
    c.n_candidates,
    c.n_selected,
    c.sample_budget,
    c.token_fraction,
    c.token_threshold,
    c.tokens_candidate,
    c.tokens_kept,
    c.adv_var_before,
    c.adv_var_after,
    CASE s.side WHEN 'A' THEN o.kept_by_a_only ELSE o.kept_by_b_only END AS kept_only_here,
    o.kept_by_both,
    o.common_candidates
FROM (VALUES ('A', $a), ('B', $b)) AS s(side, curation_id)
JOIN curations c USING (curation_id)
CROSS JOIN overlap o
ORDER BY s.side;
