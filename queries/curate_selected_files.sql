-- Which input shards hold at least one selected row: the only shards the materialisation opens.
-- `rollout_files` is (rollout_id, filename) over the snapshot's rollouts shards (DuckDB reads only
-- the rollout_id column and the footers); the caller keeps the manifest order of the files.
SELECT DISTINCT f.filename
FROM rollout_files f
SEMI JOIN (SELECT rollout_id FROM work WHERE selected) w USING (rollout_id);
