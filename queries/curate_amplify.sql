-- Amplification — the factor (docs/curation.md §Amplification). Reads, per row, the correctness, group
-- accuracy p = amp_k / amp_n and advantage amp_adv it should act on (the full group's, or a PODS
-- subset's), and sets amplification w and advantage_final = f32(w · amp_adv).
--   $mode 'da3po': w = clip(p(1−q̂) / (q̂(1−p)), 1, w_max); q̂ undefined → 1; q̂ = 0 → w_max.
--   $mode 'group': w = min(w_max, 1 / (2·sqrt(p(1−p)))).
-- Only rows with amp_on, `correct` true, p < τ (exact: k·τ_den < τ_num·n) and amp_adv > 0 are
-- amplified; every other row keeps w = 1 and advantage_final = its advantage.
CREATE OR REPLACE TEMP TABLE work AS
WITH factor AS (
    SELECT
        w.*,
        d.q_hat,
        w.amp_k::DOUBLE / w.amp_n                   AS p,
        w.amp_on AND w.correct
            AND w.amp_k::HUGEINT * $tau_den < $tau_num::HUGEINT * w.amp_n
            AND w.amp_adv > 0                       AS hard_correct
    FROM work w
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
    c.* EXCLUDE (q_hat, p, hard_correct, w, amp_on, amp_k, amp_n, amp_adv),
    CASE WHEN $mode = 'da3po' AND c.group_size IS NOT NULL THEN c.q_hat::FLOAT END AS difficulty,
    CASE WHEN c.group_size IS NOT NULL THEN c.w::FLOAT END                          AS amplification,
    CASE WHEN c.group_size IS NOT NULL THEN (c.w * c.amp_adv::DOUBLE)::FLOAT END   AS advantage_final
FROM chosen c;
