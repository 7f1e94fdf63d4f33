-- The default current_version (docs/curation.md §Parameters): the newest checkpoint's version.
SELECT max(version) AS version
FROM checkpoints;
