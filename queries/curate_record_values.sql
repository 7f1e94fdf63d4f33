-- Record — the advantages behind the record's variances. The pool entering step 6 is every row
-- that ended 'selected' or 'not_selected' (window rows replay did not choose never entered it); before PODS re-normalises, its advantages are
-- advantage_raw. adv_var_before = population variance of `before` over these rows,
-- adv_var_after = of `after` over the selected ones. The caller computes both with exactly
-- rounded sums (math.fsum of the values, then of the squared deviations from their mean), so the
-- numbers do not depend on row order, threads or engine.
SELECT
    CASE WHEN $pods THEN advantage_raw ELSE advantage_final END::DOUBLE     AS before,
    advantage_final::DOUBLE                                                 AS after,
    selected
FROM work
WHERE reason IN ('selected', 'not_selected') AND NOT replay_dropped;
