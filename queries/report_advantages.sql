-- Report, advantages: histograms (30 equal bins over the common range) of the candidates' advantages
-- in the curations in scope (the curation $curation_id; every curation when that is NULL), at three points:
--   raw        advantage_raw of every row that reached group statistics (before filter and amplification)
--   pool       advantage_final of the rows that entered sample selection (after filter and amplification)
--   selected   advantage_final of the selected rows (what the learner receives)
-- Scope: the curation $curation_id, else the curations of the recipe $recipe, else every curation.
WITH scoped AS (
    SELECT * FROM selections
    WHERE ($curation_id IS NULL OR curation_id = $curation_id)
      AND ($recipe IS NULL OR curation_id IN (SELECT curation_id FROM curations WHERE recipe = $recipe))
),
vals AS (
    SELECT 1 AS k, 'raw' AS series, advantage_raw::DOUBLE AS a FROM scoped WHERE advantage_raw IS NOT NULL
    UNION ALL
    SELECT 2, 'pool', advantage_final::DOUBLE FROM scoped WHERE reason IN ('selected', 'not_selected')
    UNION ALL
    SELECT 3, 'selected', advantage_final::DOUBLE FROM scoped WHERE selected
),
bounds AS (
    SELECT min(a) AS lo, max(a) AS hi, (max(a) - min(a)) / 30 AS width FROM vals
),
counts AS (
    SELECT k, series,
           coalesce(least(29, floor((a - lo) / nullif(width, 0)))::INTEGER, 0) AS bin,
           count(*) AS n
    FROM vals, bounds
    GROUP BY ALL
),
grid AS (
    SELECT k, series, unnest(range(30)) AS bin
    FROM (VALUES (1, 'raw'), (2, 'pool'), (3, 'selected')) s(k, series)
)
SELECT
    g.series,
    g.bin,
    b.lo + g.bin * b.width                   AS bin_lo,
    b.lo + (g.bin + 1) * b.width             AS bin_hi,
    coalesce(c.n, 0)                         AS n
FROM grid g
CROSS JOIN bounds b
LEFT JOIN counts c USING (k, series, bin)
WHERE b.lo IS NOT NULL
ORDER BY g.k, g.bin;
