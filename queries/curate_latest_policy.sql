-- The default current_version when the batch's runs have no checkpoint (docs/choices.md §Runs): the
-- newest policy_version any row of those runs was sampled with.
SELECT max(policy_version) AS version
FROM {rollouts}
WHERE list_contains($runs, run_id);
