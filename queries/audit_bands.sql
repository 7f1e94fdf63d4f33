-- Keep rate by difficulty band: by the group's accuracy (where dynamic sampling acts) and by the
-- estimated difficulty q̂ (where amplification acts; only with amplify=da3po).
WITH banded AS (
    SELECT
        selected, tokens_total, tokens_kept, amplification,
        accuracy_band_key(group_accuracy)[3:]   AS accuracy_band,   -- macros of views.sql
        difficulty_band_key(difficulty)[3:]     AS difficulty_band
    FROM selections
    WHERE curation_id = $curation_id
)
SELECT
    'group accuracy'                                   AS measure,
    accuracy_band                                      AS band,
    count(*)                                           AS candidates,
    count(*) FILTER (WHERE selected)                   AS selected,
    round(avg(selected::INTEGER), 3)                   AS keep_rate,
    round(sum(tokens_kept) / nullif(sum(tokens_total), 0), 3) AS token_keep_rate,
    round(max(amplification), 3)                       AS max_amplification
FROM banded GROUP BY accuracy_band
UNION ALL
SELECT
    'difficulty', difficulty_band, count(*), count(*) FILTER (WHERE selected),
    round(avg(selected::INTEGER), 3), round(sum(tokens_kept) / nullif(sum(tokens_total), 0), 3),
    round(max(amplification), 3)
FROM banded WHERE difficulty_band IS NOT NULL GROUP BY difficulty_band
ORDER BY measure DESC, band;
