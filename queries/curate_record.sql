-- Record (docs/curation.md §Record): the run's counts for `curations`, per (reason, selected, and
-- for a selected row its input shard) — one scan of `work` for everything the record counts. The
-- caller sums them: candidates and their tokens (all rows), selected rows and their tokens, the
-- candidates per audit reason, and the input shards that hold a selected row with how many (the
-- only shards the token and materialisation steps open; the caller keeps the snapshot's order of
-- the files). The variances adv_var_before / adv_var_after are computed from
-- curate_record_values.sql with exactly rounded sums, independent of row order.
SELECT
    reason,
    selected,
    CASE WHEN selected THEN filename END                AS filename,
    count(*)                                            AS n,
    coalesce(sum(tokens_total), 0)::BIGINT              AS tokens
FROM work
GROUP BY ALL;
