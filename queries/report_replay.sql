-- Report, replay (docs/replay.md): per curation in the order they ran, how many selected rows came
-- from the replay window, their share, and the age distribution of the selected rows
-- (`age:rows`, youngest first). Curations without replayed rows show share 0.
WITH per_age AS (
    SELECT curation_id, age, count(*) AS n
    FROM selections
    WHERE selected
    GROUP BY curation_id, age
),
ages AS (
    SELECT curation_id, string_agg(coalesce(age::VARCHAR, '?') || ':' || n::VARCHAR, ' ' ORDER BY age) AS ages
    FROM per_age
    GROUP BY curation_id
),
counts AS (
    SELECT curation_id,
           count(*) FILTER (WHERE selected)                                     AS selected,
           count(*) FILTER (WHERE selected AND coalesce(replayed, false))       AS replayed,
           count(*) FILTER (WHERE reason = 'reused')                            AS at_use_cap
    FROM selections
    GROUP BY curation_id
)
SELECT
    row_number() OVER (ORDER BY c.created_at, c.curation_id)        AS seq,
    c.curation_id,
    c.recipe,
    coalesce(k.selected, 0)                                         AS selected,
    coalesce(k.replayed, 0)                                         AS replayed,
    round(coalesce(k.replayed, 0) / nullif(k.selected, 0), 3)       AS replay_share,
    coalesce(a.ages, '')                                            AS selected_by_age,
    coalesce(k.at_use_cap, 0)                                       AS at_use_cap
FROM curations c
LEFT JOIN counts k USING (curation_id)
LEFT JOIN ages a USING (curation_id)
ORDER BY seq;
