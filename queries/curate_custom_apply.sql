-- Custom recipe, applied (to `work`, in place): rows the recipe returned (`custom_choice`,
-- checked) become 'selected' with its advantage and weight; the rest of the pool 'not_selected';
-- earlier reasons stay (with `selected` false, as created).
UPDATE work SET
    reason          = CASE WHEN c.chosen THEN 'selected' ELSE 'not_selected' END,
    selected        = c.chosen,
    advantage_final = CASE WHEN c.chosen THEN c.adv ELSE work.advantage_final END,
    weight          = coalesce(c.wt, work.weight)
FROM (SELECT w.rollout_id, ch.rollout_id IS NOT NULL AS chosen, ch.adv, ch.wt
      FROM work w LEFT JOIN custom_choice ch ON ch.rollout_id = w.rollout_id
      WHERE w.reason IS NULL) c
WHERE work.rollout_id = c.rollout_id;
