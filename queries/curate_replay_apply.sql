-- Replay, applied: window rows the replay stage did not choose leave the pool as 'not_selected'
-- (they stay replay candidates of later curations); chosen ones stay in the pool beside the fresh
-- batch, and every later stage treats them like fresh rows.
CREATE OR REPLACE TEMP TABLE work AS
SELECT
    w.* EXCLUDE (reason, selected, replay_dropped),
    CASE WHEN w.reason IS NULL AND w.replayed AND NOT coalesce(c.chosen, false) THEN 'not_selected'
         ELSE w.reason END                                                              AS reason,
    CASE WHEN w.reason IS NULL AND w.replayed AND NOT coalesce(c.chosen, false) THEN false
         ELSE w.selected END                                                            AS selected,
    w.replay_dropped OR (w.reason IS NULL AND w.replayed AND NOT coalesce(c.chosen, false)) AS replay_dropped
FROM work w
LEFT JOIN replay_choice c USING (rollout_id);
