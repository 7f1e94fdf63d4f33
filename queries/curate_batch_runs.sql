-- The runs of a batch (docs/choices.md §Runs): the distinct run_id of the rows `where` matches.
-- The default current_version is taken from these runs' versions only.
SELECT DISTINCT run_id
FROM {rollouts} AS rollouts
WHERE ({where})
ORDER BY run_id;
