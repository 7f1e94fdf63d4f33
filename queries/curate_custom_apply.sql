-- Custom recipe, applied: rows the recipe returned (`custom_choice`, checked) become 'selected'
-- with its advantage and weight; the rest of the pool 'not_selected'; earlier reasons stay.
CREATE OR REPLACE TEMP TABLE work AS
SELECT
    w.* EXCLUDE (reason, selected, advantage_final, weight),
    CASE WHEN w.reason IS NOT NULL THEN w.reason
         WHEN c.rollout_id IS NOT NULL THEN 'selected'
         ELSE 'not_selected' END                                            AS reason,
    c.rollout_id IS NOT NULL                                                AS selected,
    CASE WHEN c.rollout_id IS NOT NULL THEN c.adv ELSE w.advantage_final END AS advantage_final,
    coalesce(c.wt, w.weight)                                                AS weight
FROM work w
LEFT JOIN custom_choice c USING (rollout_id);
