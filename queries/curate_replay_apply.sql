-- Replay, applied (to `work`, in place): window rows the replay stage did not choose leave the
-- pool as 'not_selected' (they stay replay candidates of later curations); chosen ones stay in the
-- pool beside the fresh batch, and every later stage treats them like fresh rows.
UPDATE work SET reason = 'not_selected', selected = false, replay_dropped = true
WHERE reason IS NULL AND replayed
  AND rollout_id NOT IN (SELECT rollout_id FROM replay_choice WHERE chosen);
