-- No token selection: no entropies are read; the loss masks keep every token.
CREATE OR REPLACE TEMP TABLE selected_entropies AS
SELECT NULL::VARCHAR AS rollout_id, NULL::FLOAT AS advantage_final, NULL::FLOAT[] AS entropies
WHERE false;
