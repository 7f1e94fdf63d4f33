-- Amplification without a difficulty estimate (every amplify mode but da3po): an empty table, so
-- curate_amplify.sql reads the same relations in every plan.
CREATE OR REPLACE TEMP TABLE difficulty AS
SELECT NULL::VARCHAR AS group_id, NULL::DOUBLE AS q_hat
WHERE false;
