-- Token selection, input (docs/curation.md §Token selection): the per-token entropies of the
-- selected rows, read from Parquet once per curation and kept in the session. The engines bind
-- {rollouts} to the shards that hold a selected row (never the others); the threshold passes,
-- the tokens-kept counts and the loss masks all read this table, not Parquet.
CREATE OR REPLACE TEMP TABLE selected_entropies AS
SELECT r.rollout_id, w.advantage_final, r.entropies
FROM {rollouts} r
JOIN (SELECT rollout_id, advantage_final FROM work WHERE selected) w USING (rollout_id);
