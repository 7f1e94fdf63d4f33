-- Amplification on the full group (every sample mode but PODS): no re-normalised subset, so
-- curate_amplify.sql acts on each row's advantage_raw.
CREATE OR REPLACE TEMP TABLE subset_adv AS
SELECT NULL::VARCHAR AS rollout_id, 0 AS g_size, 0 AS g_correct, 0.0::FLOAT AS adv
WHERE false;
