-- The batch's size (docs/curation.md §Eligibility): candidates matched by `where`. Counts add up
-- over partitions; a batch of none is the error "empty batch", and nothing is committed.
SELECT count(*) AS n
FROM work;
