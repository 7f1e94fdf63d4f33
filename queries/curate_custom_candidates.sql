-- Custom recipe input (docs/curation.md §Custom recipes): the `candidates` view a custom recipe's
-- SELECT reads — every rollouts column of each row still in the pool, with its group statistics,
-- difficulty and advantages (`advantage` = advantage_final after amplification).
CREATE OR REPLACE TEMP VIEW candidates AS
SELECT r.*, w.group_size, w.group_accuracy, w.difficulty, w.advantage_raw,
       w.advantage_final AS advantage
FROM work w JOIN rollouts r USING (rollout_id)
WHERE w.reason IS NULL;
