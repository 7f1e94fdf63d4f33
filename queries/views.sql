-- User views over a snapshot. `rollouts`, `curated`, `selections`, `curations`, `checkpoints`,
-- `training` and `evaluations` are already views over the snapshot's Parquet files.

-- One row per group: responses sampled together for one prompt at one step.
CREATE OR REPLACE VIEW groups AS
SELECT
    group_id,
    any_value(prompt_id)                          AS prompt_id,
    any_value(run_id)                             AS run_id,
    any_value(step)                               AS step,
    any_value(policy_version)                     AS policy_version,
    count(*)                                      AS size,
    count(correct)                                AS judged,
    count(*) FILTER (WHERE correct)               AS n_correct,
    avg(correct::INTEGER)                         AS accuracy,
    avg(reward::DOUBLE)                           AS reward_mean,
    stddev_samp(reward::DOUBLE)                   AS reward_std,
    sum(response_length)                          AS tokens,  -- stored (computed for shards of schema version 2)
    min(created_at)                               AS created_at
FROM rollouts
GROUP BY group_id;

-- Each run's policy versions in order (docs/choices.md §Runs): versions are numbered buffer-wide, so
-- a second run samples at v0 and then publishes v21, v22, … after a 20-version one; `run_version`
-- n is the run's n-th version (0: the first it sampled, trained or was evaluated with). The report
-- draws per-version charts against it, one line per run.
CREATE OR REPLACE VIEW run_versions AS
SELECT
    run_id,
    policy_version,
    (dense_rank() OVER (PARTITION BY run_id ORDER BY policy_version) - 1)::BIGINT AS run_version
FROM (
    SELECT run_id, policy_version FROM rollouts
    UNION SELECT run_id, version AS policy_version FROM checkpoints
    UNION SELECT run_id, policy_version FROM evaluations WHERE run_id IS NOT NULL AND policy_version IS NOT NULL
);

-- Per-prompt history by policy version: judged attempts, correct answers, that version's accuracy,
-- and the pooled accuracy over every version up to and including it.
CREATE OR REPLACE VIEW prompts AS
WITH per_version AS (
    SELECT
        prompt_id,
        policy_version,
        count(DISTINCT group_id)                                   AS groups,
        count(*) FILTER (WHERE correct IS NOT NULL AND verify_error IS NULL) AS attempts,
        count(*) FILTER (WHERE correct AND verify_error IS NULL)   AS correct
    FROM rollouts
    GROUP BY prompt_id, policy_version
)
SELECT
    prompt_id,
    policy_version,
    groups,
    attempts,
    correct,
    correct / nullif(attempts, 0)                                  AS accuracy,
    sum(correct) OVER w / nullif(sum(attempts) OVER w, 0)          AS pooled_accuracy
FROM per_version
WINDOW w AS (PARTITION BY prompt_id ORDER BY policy_version
             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW);

-- Difficulty bands of the audit (`audit_bands.sql`, `report_bands.sql`): a label behind a digit that
-- orders the bands ('2 acc (0, .25)'); `[3:]` strips the digit. By the group's accuracy (where
-- dynamic sampling acts) and by the estimated difficulty q̂ (where amplification acts).
CREATE OR REPLACE MACRO accuracy_band_key(acc) AS
    CASE
        WHEN acc IS NULL THEN '0 ineligible'
        WHEN acc = 0 THEN '1 acc = 0'
        WHEN acc < 0.25 THEN '2 acc (0, .25)'
        WHEN acc < 0.5 THEN '3 acc [.25, .5)'
        WHEN acc < 0.75 THEN '4 acc [.5, .75)'
        WHEN acc < 1 THEN '5 acc [.75, 1)'
        ELSE '6 acc = 1'
    END;

CREATE OR REPLACE MACRO difficulty_band_key(q) AS
    CASE
        WHEN q IS NULL THEN NULL
        WHEN q < 0.25 THEN '1 q̂ [0, .25)'
        WHEN q < 0.5 THEN '2 q̂ [.25, .5)'
        WHEN q < 0.75 THEN '3 q̂ [.5, .75)'
        ELSE '4 q̂ [.75, 1]'
    END;
