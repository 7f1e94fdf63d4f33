-- Record (docs/curation.md §Record): the run's counts for `curations`. The variances
-- adv_var_before / adv_var_after are computed from curate_record_values.sql with exactly rounded
-- sums, independent of row order.
SELECT
    count(*)                                                                AS n_candidates,
    count(*) FILTER (WHERE selected)                                        AS n_selected,
    coalesce(sum(tokens_total), 0)                                          AS tokens_candidate,
    coalesce(sum(tokens_total) FILTER (WHERE selected), 0)                  AS tokens_selected
FROM work;
