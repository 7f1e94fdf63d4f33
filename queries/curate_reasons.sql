-- Record: candidates per audit reason.
SELECT reason, count(*) AS n
FROM work
GROUP BY reason
ORDER BY reason;
