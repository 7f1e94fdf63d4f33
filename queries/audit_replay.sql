-- Replay (docs/replay.md): one curation's candidates by origin — the fresh batch or the replay
-- window — and age in policy versions: candidates, selected, tokens kept, and the share of the
-- curation's selected rows. Curations made before replay existed read as fresh with a null age.
SELECT
    CASE WHEN coalesce(replayed, false) THEN 'replayed' ELSE 'fresh' END       AS origin,
    age,
    count(*)                                                                AS candidates,
    count(*) FILTER (WHERE selected)                                        AS selected,
    sum(tokens_kept)                                                        AS tokens_kept,
    round(count(*) FILTER (WHERE selected)
          / nullif(sum(count(*) FILTER (WHERE selected)) OVER (), 0), 3)    AS share_of_selected,
    max(uses)                                                               AS max_uses_before
FROM selections
WHERE curation_id = $curation_id
GROUP BY ALL
ORDER BY origin, age;
