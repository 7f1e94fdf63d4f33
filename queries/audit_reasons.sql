-- Reason counts of one curation, with the tokens each reason holds and keeps.
SELECT
    reason,
    count(*)                         AS candidates,
    sum(tokens_total)                AS tokens,
    sum(tokens_kept)                 AS tokens_kept
FROM selections
WHERE curation_id = $curation_id
GROUP BY reason
ORDER BY candidates DESC, reason;
