-- Report, curations: one row per curation run in the order they ran (`seq`), with its record
-- (schedule position, budgets, kept samples and tokens, Var(A) before and after selection) and its
-- candidates counted by reason from the audit. Every curation of the snapshot, whatever --curation.
WITH reasons AS (
    SELECT
        curation_id,
        count(*) FILTER (WHERE reason = 'selected')        AS selected,
        count(*) FILTER (WHERE reason = 'not_selected')    AS not_selected,
        count(*) FILTER (WHERE reason = 'zero_variance')   AS zero_variance,
        count(*) FILTER (WHERE reason = 'invalid')         AS invalid,
        count(*) FILTER (WHERE reason = 'truncated')       AS truncated,
        count(*) FILTER (WHERE reason = 'stale')           AS stale,
        count(*) FILTER (WHERE reason = 'reused')          AS reused
    FROM selections
    GROUP BY curation_id
)
SELECT
    row_number() OVER (ORDER BY c.created_at, c.curation_id)      AS seq,
    c.curation_id,
    c.recipe,
    c.created_at,
    c.snapshot_seq,
    c.progress,
    c.n_candidates,
    c.n_selected,
    c.sample_budget,
    c.n_selected / nullif(c.n_candidates, 0)                      AS sample_keep_rate,
    c.token_fraction,
    c.token_threshold,
    c.tokens_candidate,
    c.tokens_kept,
    c.tokens_kept / nullif(c.tokens_candidate, 0)                 AS token_keep_rate,
    c.adv_var_before,
    c.adv_var_after,
    coalesce(r.selected, 0)                                        AS selected,
    coalesce(r.not_selected, 0)                                    AS not_selected,
    coalesce(r.zero_variance, 0)                                   AS zero_variance,
    coalesce(r.invalid, 0)                                         AS invalid,
    coalesce(r.truncated, 0)                                       AS truncated,
    coalesce(r.stale, 0)                                           AS stale,
    coalesce(r.reused, 0)                                          AS reused
FROM curations c
LEFT JOIN reasons r USING (curation_id)
ORDER BY seq;
