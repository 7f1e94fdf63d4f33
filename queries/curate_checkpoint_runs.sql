-- Each checkpoint's run and version (docs/choices.md §Runs): the default current_version of a batch
-- is the newest version of a checkpoint of its own run. One row per checkpoint shard.
SELECT filename, run_id, version
FROM read_parquet({files}, filename = true);
