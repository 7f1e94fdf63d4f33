-- Amplification — μ of the Beta prior (docs/curation.md §Amplification): correct rows k and rows n among the candidates
-- that reached group statistics; μ = k / n. Integer counts, so partitions add up exactly.
SELECT count(*) FILTER (WHERE correct) AS k, count(*) AS n
FROM work
WHERE group_size IS NOT NULL;
