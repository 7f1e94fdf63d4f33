-- Replay (docs/replay.md §Window): the runs of the fresh batch. The window is drawn from the batch's
-- own run, so a replay curation over rows of several runs (other models, other tasks) is refused.
SELECT DISTINCT run_id
FROM work
WHERE NOT replayed
ORDER BY run_id;
