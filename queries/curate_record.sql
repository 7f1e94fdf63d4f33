-- Step 9 — the run's numbers for `curations`. The pool entering step 6 is every row that ended
-- 'selected' or 'not_selected'; before PODS re-normalises, its advantages are advantage_raw.
SELECT
    count(*)                                                                AS n_candidates,
    count(*) FILTER (WHERE selected)                                        AS n_selected,
    coalesce(sum(tokens_total), 0)                                          AS tokens_candidate,
    var_pop(CASE WHEN $pods THEN advantage_raw ELSE advantage_final END::DOUBLE)
        FILTER (WHERE reason IN ('selected', 'not_selected'))               AS adv_var_before,
    var_pop(advantage_final::DOUBLE) FILTER (WHERE selected)                AS adv_var_after
FROM work;
