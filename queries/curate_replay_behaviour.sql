-- Replay (docs/replay.md §The loss): a replayed row is trained against its behaviour log-probs. The
-- first eligible window row (by rollout_id) whose only log-probs were recomputed at import by
-- another model (old_logprobs null, gen_logprobs recomputed) is the error the run stops with.
SELECT rollout_id
FROM work
WHERE replayed AND reason IS NULL AND NOT has_behaviour
ORDER BY rollout_id
LIMIT 1;
