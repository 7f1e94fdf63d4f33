-- Amplification input — the difficulty history (docs/curation.md §Amplification): per prompt, the judged attempts
-- (`correct` not null, `verify_error` null) within the last $window policy versions
-- [current_version − W + 1, current_version], from any run and any step, whatever their
-- eligibility in this run. Integer counts, so per-shard partial histories add up exactly.
CREATE OR REPLACE TEMP TABLE {out} AS
SELECT prompt_id, count(*) AS n, count(*) FILTER (WHERE correct) AS k
FROM {rows}
WHERE correct IS NOT NULL AND verify_error IS NULL
  AND policy_version BETWEEN $current_version - $window + 1 AND $current_version
GROUP BY prompt_id;
