-- `rollstore import --from` (docs/importers.md §Verdicts): the stored `correct` of rows a re-import
-- finds already in the buffer, to refuse a second import that derives them differently.
SELECT rollout_id, correct
FROM rollouts
WHERE list_contains($ids, rollout_id);
