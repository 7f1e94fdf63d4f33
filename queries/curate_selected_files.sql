-- The input shards that hold a selected row, with how many: the only shards the token and
-- materialisation steps open (the caller keeps the snapshot's order of the files).
SELECT filename, count(*) AS n
FROM work
WHERE selected
GROUP BY filename;
