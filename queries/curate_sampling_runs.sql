-- Which of $runs sampled rollouts (docs/choices.md §Runs): a run that only trains (published
-- checkpoints, sampled nothing — `rollstore train`'s run) is the learner of every run that has no
-- checkpoint of its own.
SELECT DISTINCT run_id
FROM {rollouts}
WHERE list_contains($runs, run_id);
