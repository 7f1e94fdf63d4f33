-- Token selection, input (docs/curation.md §Token selection): the selected rows, each with its
-- input shard (`filename`) and position there (`rollouts_row`, as the candidates' scan read it).
-- A view, not data: the token stage's kernels read it once per session or task and read the rows'
-- entropies from those shards themselves (curate/kernels.py scored_chunks: only the row groups
-- holding a selected row, only that column), so no token list passes through DuckDB. The engines
-- give `work` the rows of the shards that hold a selected row (a Dask task: one shard's).
CREATE OR REPLACE TEMP VIEW selected_rows AS
SELECT rollout_id, advantage_final, filename, rollouts_row
FROM work
WHERE selected;
