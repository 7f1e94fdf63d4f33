-- Report, keep rate by difficulty band: candidates of the curations in scope (the curation $curation_id;
-- every curation when that is NULL) banded by their group's accuracy (where dynamic sampling acts) and by
-- the estimated difficulty q̂ (where amplification acts; only recorded with amplify=da3po).
-- Scope: the curation $curation_id, else the curations of the recipe $recipe, else every curation.
WITH scoped AS (
    SELECT * FROM selections
    WHERE ($curation_id IS NULL OR curation_id = $curation_id)
      AND ($recipe IS NULL OR curation_id IN (SELECT curation_id FROM curations WHERE recipe = $recipe))
),
banded AS (
    SELECT
        selected, tokens_total, tokens_kept, amplification,
        accuracy_band_key(group_accuracy)       AS accuracy_band,   -- macros of views.sql
        difficulty_band_key(difficulty)         AS difficulty_band
    FROM scoped
),
long AS (
    SELECT 'group accuracy' AS measure, accuracy_band AS band_key, * EXCLUDE (accuracy_band, difficulty_band) FROM banded
    UNION ALL
    SELECT 'difficulty', difficulty_band, * EXCLUDE (accuracy_band, difficulty_band) FROM banded
    WHERE difficulty_band IS NOT NULL
)
SELECT
    measure,
    band_key[3:]                                            AS band,  -- the key's digit orders the bands
    count(*)                                                AS candidates,
    count(*) FILTER (WHERE selected)                        AS selected,
    avg(selected::INTEGER)                                  AS keep_rate,
    sum(tokens_total)::BIGINT                               AS tokens_total,
    sum(tokens_kept)::BIGINT                                AS tokens_kept,
    sum(tokens_kept) / nullif(sum(tokens_total), 0)         AS token_keep_rate,
    count(*) FILTER (WHERE amplification > 1)               AS amplified,
    max(amplification)                                      AS max_amplification
FROM long
GROUP BY measure, band_key
ORDER BY measure DESC, band_key;
