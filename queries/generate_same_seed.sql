-- `rollstore generate` (docs/multihost.md): another run that sampled this step with the same derived
-- seed (`meta.seed`): the same prompts and, from the same model, the same samples.
SELECT run_id
FROM rollouts
WHERE run_id <> $run_id AND step = $step AND json_extract(meta, '$.seed')::BIGINT = $seed
LIMIT 1;
