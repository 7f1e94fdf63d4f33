-- The live curations of exactly one loop step's rows ($where: the step's predicate, `step_where`),
-- newest first: what a loop killed after that step's curation commit left behind
-- (rollstore.loop.step.committed_curation). A curation record's `params` holds its resolved `where`.
SELECT *
FROM curations
WHERE json_extract_string(params, '$.where') = $where
ORDER BY snapshot_seq DESC, created_at DESC, curation_id DESC;
