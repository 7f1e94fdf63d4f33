-- Eligibility, completed: a candidate without `entropies` (allowed while it is not selected) takes
-- its token count from `response_token_ids`. The engines run this only when such a row exists.
UPDATE work SET tokens_total = l.n
FROM (
    SELECT rollout_id, len(response_token_ids)::INTEGER AS n
    FROM {rollouts}
    WHERE rollout_id IN (SELECT rollout_id FROM work WHERE tokens_total IS NULL)
) l
WHERE work.rollout_id = l.rollout_id;
