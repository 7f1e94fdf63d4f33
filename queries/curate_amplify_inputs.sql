-- Amplification inputs — what amplification acts on, per row: the full group (p = k/G, advantage_raw), or,
-- with PODS, the chosen subset of a selected row (p = k'/m, the subset's re-normalised advantage;
-- `subset_adv` holds it). Rows outside the statistics, or out of the pool (filtered, or window rows
-- replay did not choose), are never amplified.
CREATE OR REPLACE TEMP TABLE work AS
SELECT
    w.*,
    $amplify_on AND w.group_size IS NOT NULL
        AND CASE WHEN $pods THEN coalesce(w.selected, false) ELSE w.reason IS NULL END   AS amp_on,
    CASE WHEN $pods AND w.selected THEN s.g_correct ELSE w.g_correct END                    AS amp_k,
    CASE WHEN $pods AND w.selected THEN s.g_size ELSE w.group_size END                      AS amp_n,
    CASE WHEN $pods AND w.selected THEN s.adv ELSE w.advantage_raw END                      AS amp_adv
FROM work w
LEFT JOIN subset_adv s USING (rollout_id);
