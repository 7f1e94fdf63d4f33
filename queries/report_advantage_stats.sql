-- Report, advantages: count, mean, population variance and range of the same three series as
-- report_advantages.sql, plus how many rows amplification changed (amplification > 1).
-- Scope: the curation $curation_id, else the curations of the recipe $recipe, else every curation.
WITH scoped AS (
    SELECT * FROM selections
    WHERE ($curation_id IS NULL OR curation_id = $curation_id)
      AND ($recipe IS NULL OR curation_id IN (SELECT curation_id FROM curations WHERE recipe = $recipe))
),
vals AS (
    SELECT 1 AS k, 'raw' AS series, advantage_raw::DOUBLE AS a, amplification FROM scoped WHERE advantage_raw IS NOT NULL
    UNION ALL
    SELECT 2, 'pool', advantage_final::DOUBLE, amplification FROM scoped WHERE reason IN ('selected', 'not_selected')
    UNION ALL
    SELECT 3, 'selected', advantage_final::DOUBLE, amplification FROM scoped WHERE selected
)
SELECT
    series,
    count(*)                                  AS n,
    avg(a)                                    AS mean,
    var_pop(a)                                AS var_pop,
    min(a)                                    AS min,
    max(a)                                    AS max,
    count(*) FILTER (WHERE amplification > 1) AS amplified,
    avg(amplification) FILTER (WHERE amplification > 1) AS mean_amplification
FROM vals
GROUP BY k, series
ORDER BY k;
