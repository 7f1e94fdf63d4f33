-- Report, tokens: a handful of candidates of the curations in scope (the curation $curation_id;
-- every curation when that is NULL), with their tokens: up to 6 selected rows (partly pruned ones first) and up
-- to 6 rejected ones taken in turn from each reason (up to 2 of the selected ones replayed, when any
-- was; `replayed` and `age` mark them); within a reason the order is md5 of
-- (curation_id, rollout_id), so the same snapshot always shows the same rollouts. Each token's
-- score is |advantage_final|·H (null when the row has no advantage or no entropies) and `kept` is
-- the curated loss mask (all false for rejected rows). At most 400 tokens of a response are shown.
-- Scope: the curation $curation_id, else the curations of the recipe $recipe, else every curation.
WITH scoped AS (
    SELECT * FROM selections
    WHERE ($curation_id IS NULL OR curation_id = $curation_id)
      AND ($recipe IS NULL OR curation_id IN (SELECT curation_id FROM curations WHERE recipe = $recipe))
),
keyed AS (  -- each row's place in its reason's order (rank_in_reason below): partly pruned selected rows first
    SELECT *,
           CASE WHEN selected THEN '' ELSE reason END                                    AS part,
           {'unpruned': NOT (selected AND tokens_kept > 0 AND tokens_kept < tokens_total),
            'h': md5(curation_id || '/' || rollout_id)}                                  AS place
    FROM scoped
),
cut AS (  -- the 6th place of each reason: no row past it can be picked
    SELECT selected, part, max(p) AS last_place
    FROM (SELECT selected, part, unnest(min(place, 6)) AS p FROM keyed GROUP BY selected, part)
    GROUP BY selected, part
),
cut_replayed AS (  -- the 2nd md5 of the selected replayed rows (rank_in_replayed <= 2)
    SELECT max(h) AS last_h FROM (SELECT unnest(min(place.h, 2)) AS h FROM keyed WHERE selected AND replayed IS TRUE)
),
ranked AS (  -- ranked among the rows `cut` keeps: the same order as among every row of the scope, so the
             -- same picks, and the window sorts a few dozen rows instead of every candidate
    SELECT
        k.* EXCLUDE (part, place),
        row_number() OVER (
            PARTITION BY selected, CASE WHEN selected THEN '' ELSE reason END
            ORDER BY (selected AND tokens_kept > 0 AND tokens_kept < tokens_total) DESC,
                     md5(curation_id || '/' || rollout_id)
        ) AS rank_in_reason,
        row_number() OVER (
            PARTITION BY selected, replayed IS TRUE ORDER BY md5(curation_id || '/' || rollout_id)
        ) AS rank_in_replayed
    FROM keyed k
    JOIN cut c USING (selected, part)
    CROSS JOIN cut_replayed r
    WHERE k.place <= c.last_place
       OR (k.selected AND k.replayed IS TRUE AND k.place.h <= r.last_h)
),
picks AS (  -- up to 2 of the selected rows are replayed ones, when the scope replayed any
    (SELECT * FROM ranked WHERE selected
     ORDER BY (replayed IS TRUE AND rank_in_replayed <= 2) DESC, rank_in_reason LIMIT 6)
    UNION ALL
    (SELECT * FROM ranked WHERE NOT selected ORDER BY rank_in_reason, reason LIMIT 6)
)
-- The picked rows with their rollouts and curated masks:
SELECT
    p.curation_id,
    p.rollout_id,
    p.selected,
    p.reason,
    p.group_accuracy,
    p.difficulty,
    p.advantage_raw,
    p.amplification,
    p.advantage_final,
    p.tokens_total,
    p.tokens_kept,
    p.replayed,
    p.age,
    r.prompt,
    r.gold_answer,
    r.response,
    r.correct,
    r.reward,
    r.finish_reason,
    list_slice(r.response_token_ids, 1, 400)                                     AS token_ids,
    list_slice(r.entropies, 1, 400)                                              AS entropies,
    list_transform(list_slice(r.entropies, 1, 400),
                   lambda h: abs(p.advantage_final::DOUBLE) * h::DOUBLE)         AS scores,
    list_slice(coalesce(c.loss_mask,
                        list_transform(r.response_token_ids, lambda t: false)), 1, 400) AS kept
FROM picks p
JOIN rollouts r USING (rollout_id)
LEFT JOIN curated c ON c.curation_id = p.curation_id AND c.rollout_id = p.rollout_id
ORDER BY p.selected DESC, p.rank_in_reason, p.reason;
