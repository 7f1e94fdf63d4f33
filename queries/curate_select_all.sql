-- Sample selection with sample=none (docs/curation.md §Sample selection): every row still in the
-- pool is selected, without a rank.
CREATE OR REPLACE TEMP TABLE picked AS
SELECT rollout_id, true AS selected, NULL::INTEGER AS sample_rank
FROM work
WHERE reason IS NULL
ORDER BY rollout_id;
