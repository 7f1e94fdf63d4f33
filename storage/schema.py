"""Arrow schemas of rollstore's tables (the column contract documented in docs/schema.md).

Invariants:
- Column names and types here are a public contract; a change needs SCHEMA_VERSION bumped and a
  migration note in docs/schema.md ("Schema versions").
- Every per-token list column of a rollout has the length of `response_token_ids`.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 3  # 3: rollouts shards store response_length; 2: curated shards hold references (CURATED_REFS)

_f32_list = pa.list_(pa.float32())
_i32_list = pa.list_(pa.int32())

ROLLOUTS = pa.schema(
    [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("sample_idx", pa.int32(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("prompt_token_ids", _i32_list, nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("response_token_ids", _i32_list, nullable=False),
        pa.field("gen_logprobs", _f32_list, nullable=False),
        pa.field("old_logprobs", _f32_list, nullable=True),
        pa.field("entropies", _f32_list, nullable=True),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("correct", pa.bool_(), nullable=True),
        pa.field("gold_answer", pa.string(), nullable=True),
        pa.field("verify_error", pa.string(), nullable=True),
        pa.field("source", pa.string(), nullable=True),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("meta", pa.string(), nullable=True),
    ]
)

# A rollouts shard as stored since schema version 3: the rows as appended (`ROLLOUTS`) and each
# response's length, `len(response_token_ids)`, written by `Buffer.commit` (never taken from the
# input), so that a scan needing only the length decodes no token list. Shards of version 2 lack
# it: readers compute it there (`storage.snapshot.rollouts_relation`), `rollstore migrate` and
# compaction write it.
RESPONSE_LENGTH = "response_length"
ROLLOUTS_STORED = ROLLOUTS.append(pa.field(RESPONSE_LENGTH, pa.int32(), nullable=False))

# Per-token list columns of `rollouts`, each as long as `response_token_ids`.
TOKEN_LIST_COLUMNS = ("gen_logprobs", "old_logprobs", "entropies")
FINISH_REASONS = ("stop", "length", "abort")

# The learner's rows of a curation, resolved (the `curated` view, `export`, `learner.batches`).
CURATED = pa.schema(
    [
        pa.field("curation_id", pa.string(), nullable=False),
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("prompt_token_ids", _i32_list, nullable=False),
        pa.field("response_token_ids", _i32_list, nullable=False),
        pa.field("old_logprobs", _f32_list, nullable=False),
        pa.field("gen_logprobs", _f32_list, nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),
        pa.field("loss_mask", pa.list_(pa.bool_()), nullable=False),
        pa.field("weight", pa.float32(), nullable=False),
    ]
)

# What a curated shard stores (docs/schema.md §curated): per selected row a reference to its
# rollouts row (`rollouts_shard`, the shard's path under the buffer root as the manifest records it;
# `rollouts_row`, the row's position in that file; `rollout_id`, checked on resolution), the
# curation's numbers, and the loss mask as kept runs: [start0, end0, start1, end1, ...] response
# positions (end exclusive; [] keeps nothing). `tokens` is the response length (checked on
# resolution); `fallback` says the row had no old_logprobs (the learner uses gen_logprobs).
# No token list is copied: readers resolve references into `CURATED` (storage.references).
CURATED_REFS = pa.schema(
    [
        pa.field("curation_id", pa.string(), nullable=False),
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("rollouts_shard", pa.string(), nullable=False),
        pa.field("rollouts_row", pa.int64(), nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),
        pa.field("weight", pa.float32(), nullable=False),
        pa.field("keep_runs", _i32_list, nullable=False),
        pa.field("tokens", pa.int32(), nullable=False),
        pa.field("fallback", pa.bool_(), nullable=False),
    ]
)

SELECTIONS = pa.schema(
    [
        pa.field("curation_id", pa.string(), nullable=False),
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("group_size", pa.int32()),
        pa.field("group_accuracy", pa.float32()),
        pa.field("difficulty", pa.float32()),
        pa.field("advantage_raw", pa.float32()),
        pa.field("amplification", pa.float32()),
        pa.field("advantage_final", pa.float32()),
        pa.field("selected", pa.bool_(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("sample_rank", pa.int32()),
        pa.field("tokens_total", pa.int32(), nullable=False),
        pa.field("tokens_kept", pa.int32(), nullable=False),
        pa.field("replayed", pa.bool_()),  # from the replay window, not the fresh batch (null: before replay)
        pa.field("age", pa.int64()),  # current_version − policy_version at this curation
        pa.field("uses", pa.int32()),  # committed curations that selected it before this one
    ]
)

REASONS = ("selected", "invalid", "truncated", "stale", "reused", "zero_variance", "not_selected")

CURATIONS = pa.schema(
    [
        pa.field("curation_id", pa.string(), nullable=False),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("recipe", pa.string(), nullable=False),
        pa.field("params", pa.string(), nullable=False),
        pa.field("sql_sha256", pa.string(), nullable=False),
        pa.field("snapshot_seq", pa.int64(), nullable=False),
        pa.field("progress", pa.float64()),
        pa.field("sample_budget", pa.int64()),
        pa.field("token_fraction", pa.float64()),
        pa.field("token_threshold", pa.float64()),
        pa.field("n_candidates", pa.int64(), nullable=False),
        pa.field("n_selected", pa.int64(), nullable=False),
        pa.field("tokens_candidate", pa.int64(), nullable=False),
        pa.field("tokens_kept", pa.int64(), nullable=False),
        pa.field("adv_var_before", pa.float64()),
        pa.field("adv_var_after", pa.float64()),
        pa.field("old_logprobs_fallback", pa.int64(), nullable=False),
        pa.field("output_files", pa.string(), nullable=False),
    ]
)

CHECKPOINTS = pa.schema(
    [
        pa.field("version", pa.int64(), nullable=False),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("path", pa.string(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("parent_version", pa.int64()),
        pa.field("consumed", pa.string(), nullable=False),
        pa.field("metrics", pa.string(), nullable=False),
    ]
)

TRAINING = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("version", pa.int64(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("curation_id", pa.string()),
        pa.field("loss", pa.float64()),
        pa.field("clip_fraction", pa.float64()),
        pa.field("approx_kl", pa.float64()),
        pa.field("entropy", pa.float64()),
        pa.field("grad_norm", pa.float64()),
        pa.field("tokens", pa.int64()),
        pa.field("samples", pa.int64()),
        pa.field("lr", pa.float64()),
        pa.field("positions", pa.int64()),  # learner positions forwarded and backwarded (added: null before)
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)

EVALUATIONS = pa.schema(
    [
        pa.field("eval_id", pa.string(), nullable=False),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("run_id", pa.string()),
        pa.field("policy_version", pa.int64()),
        pa.field("iteration", pa.int64()),
        pa.field("split", pa.string()),
        pa.field("metric", pa.string(), nullable=False),
        pa.field("value", pa.float64(), nullable=False),
        pa.field("n_problems", pa.int64()),
        pa.field("n_samples", pa.int64()),
    ]
)

# Pre-rollout prompt selection (GRESO): one row per candidate prompt the loop considered before
# generating a step, with what decided it (curate.prompts; docs/curation.md §Before generation).
PROMPT_SELECTIONS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("position", pa.int64(), nullable=False),  # in the run's prompt stream
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("prompt", pa.string()),
        pa.field("groups_seen", pa.int64(), nullable=False),  # the prompt's groups in the history window
        pa.field("z", pa.int64(), nullable=False),  # newest of them that were zero-variance, consecutive
        pa.field("kind", pa.string()),  # all_correct | all_wrong (of the newest group, when z > 0)
        pa.field("explore", pa.float64(), nullable=False),  # p_e of the prompt's kind
        pa.field("p_skip", pa.float64(), nullable=False),  # 1 − p_e^z
        pa.field("draw", pa.float64(), nullable=False),  # seeded uniform in [0, 1)
        pa.field("decision", pa.string(), nullable=False),  # generate | skip
        pa.field("reason", pa.string(), nullable=False),  # no_history | informative | explored | skipped | filled
        pa.field("explore_easy", pa.float64(), nullable=False),  # the step's rates (the next step adapts them)
        pa.field("explore_hard", pa.float64(), nullable=False),
        pa.field("params", pa.string(), nullable=False),  # JSON: the selection parameters
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)

# Every table stored as Parquet shards registered in the manifest, by name.
TABLES: dict[str, pa.Schema] = {
    "rollouts": ROLLOUTS,
    "curated": CURATED_REFS,  # stored thin; the `curated` view resolves to CURATED
    "selections": SELECTIONS,
    "curations": CURATIONS,
    "checkpoints": CHECKPOINTS,
    "training": TRAINING,
    "evaluations": EVALUATIONS,
    "prompt_selections": PROMPT_SELECTIONS,
}

# The schema readers see per table (the DuckDB views, `Snapshot.arrow`/`polars`, export): as
# stored, except `curated`, which reads resolved.
READ_SCHEMAS: dict[str, pa.Schema] = {**TABLES, "curated": CURATED}


def stored_schema(table_name: str, schema: pa.Schema) -> pa.Schema:
    """The schema a shard of `table_name` is written with, given the table's own `schema`: a curated
    shard holds references (`CURATED_REFS`) unless it is materialised (token lists inside, `CURATED`:
    what version 1 wrote, and what a caller may still commit); a rollouts shard holds its
    responses' lengths too (`ROLLOUTS_STORED`)."""
    if table_name == "curated" and "rollouts_row" not in schema.names:
        return CURATED
    if table_name == "rollouts":
        return ROLLOUTS_STORED
    return TABLES[table_name]
