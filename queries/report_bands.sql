-- Report, keep rate by difficulty band: candidates of the curations in scope (the curation $curation_id;
-- every curation when that is NULL) banded by their group's accuracy (where dynamic sampling acts) and by
-- the estimated difficulty q̂ (where amplification acts; only recorded with amplify=da3po).
WITH scoped AS (
    SELECT * FROM selections
    WHERE $curation_id IS NULL OR curation_id = $curation_id
),
banded AS (
    SELECT
        selected, tokens_total, tokens_kept, amplification,
        CASE
            WHEN group_accuracy IS NULL THEN '0 ineligible'
            WHEN group_accuracy = 0 THEN '1 acc = 0'
            WHEN group_accuracy < 0.25 THEN '2 acc (0, .25)'
            WHEN group_accuracy < 0.5 THEN '3 acc [.25, .5)'
            WHEN group_accuracy < 0.75 THEN '4 acc [.5, .75)'
            WHEN group_accuracy < 1 THEN '5 acc [.75, 1)'
            ELSE '6 acc = 1'
        END AS accuracy_band,
        CASE
            WHEN difficulty IS NULL THEN NULL
            WHEN difficulty < 0.25 THEN '1 q̂ [0, .25)'
            WHEN difficulty < 0.5 THEN '2 q̂ [.25, .5)'
            WHEN difficulty < 0.75 THEN '3 q̂ [.5, .75)'
            ELSE '4 q̂ [.75, 1]'
        END AS difficulty_band
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
