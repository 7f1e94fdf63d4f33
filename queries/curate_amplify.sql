-- Amplification (docs/curation.md §Amplification): sets difficulty, amplification and
-- advantage_final of every row with group statistics, updating `work` in place (rows without
-- statistics keep NULL, as created).
-- Inputs (CTE `inputs`) — what amplification acts on, per row: the full group (p = k/G,
-- advantage_raw), or, with PODS, the chosen subset of a selected row (p = k'/m, the subset's
-- re-normalised advantage; `subset_adv` holds it). Rows outside the statistics, or out of the pool
-- (filtered, or window rows replay did not choose), are never amplified.
-- The factor: per row, the correctness, group accuracy p = amp_k / amp_n and advantage amp_adv it
-- acts on, and sets amplification w and advantage_final = f32(w · amp_adv).
--   $mode 'da3po': w = clip(p(1−q̂) / (q̂(1−p)), 1, w_max); q̂ undefined → 1; q̂ = 0 → w_max.
--   $mode 'group': w = min(w_max, 1 / (2·sqrt(p(1−p)))).
-- Only rows with amp_on, `correct` true, p < τ (exact: k·τ_den < τ_num·n) and amp_adv > 0 are
-- amplified; every other row keeps w = 1 and advantage_final = its advantage.
UPDATE work SET difficulty = a.difficulty, amplification = a.amplification, advantage_final = a.advantage_final
FROM (
    WITH inputs AS (
        SELECT
            w.rollout_id, w.group_id, w.correct, w.group_size,
            $amplify_on AND w.group_size IS NOT NULL
                AND CASE WHEN $pods THEN coalesce(w.selected, false) ELSE w.reason IS NULL END   AS amp_on,
            CASE WHEN $pods AND w.selected THEN s.g_correct ELSE w.g_correct END                    AS amp_k,
            CASE WHEN $pods AND w.selected THEN s.g_size ELSE w.group_size END                      AS amp_n,
            CASE WHEN $pods AND w.selected THEN s.adv ELSE w.advantage_raw END                      AS amp_adv
        FROM work w
        LEFT JOIN subset_adv s USING (rollout_id)
        WHERE w.group_size IS NOT NULL
    ),
    factor AS (
        SELECT
            w.*,
            d.q_hat,
            w.amp_k::DOUBLE / w.amp_n                   AS p,
            w.amp_on AND w.correct
                AND w.amp_k::HUGEINT * $tau_den < $tau_num::HUGEINT * w.amp_n
                AND w.amp_adv > 0                       AS hard_correct
        FROM inputs w
        LEFT JOIN difficulty d USING (group_id)
    ),
    chosen AS (
        SELECT
            f.*,
            CASE
                WHEN NOT coalesce(f.hard_correct, false) THEN 1.0
                WHEN $mode = 'group' THEN least($w_max, 1.0 / (2.0 * sqrt(f.p * (1.0 - f.p))))
                WHEN f.q_hat IS NULL THEN 1.0
                WHEN f.q_hat = 0 THEN $w_max
                ELSE least(greatest(f.p * (1.0 - f.q_hat) / (f.q_hat * (1.0 - f.p)), 1.0), $w_max)
            END                                         AS w
        FROM factor f
    )
    SELECT
        c.rollout_id,
        CASE WHEN $mode = 'da3po' THEN c.q_hat::FLOAT END   AS difficulty,
        c.w::FLOAT                                          AS amplification,
        (c.w * c.amp_adv::DOUBLE)::FLOAT                    AS advantage_final
    FROM chosen c
    ORDER BY c.rollout_id  -- the order of `work`: the update meets its rows in order
) a
WHERE work.rollout_id = a.rollout_id;
