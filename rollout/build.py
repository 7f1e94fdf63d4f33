"""Assemble prompts, generations and verdicts into a table in the `rollouts` schema.

Invariants:
- The result has exactly `storage.schema.ROLLOUTS` (names, types, order); it passes
  `storage.validate.validate_rollouts` whenever the inputs obey the backend contract.
- Every row is labelled by one `StepStamp` (run_id, step, policy_version, prompt_offset, created_at).
- `group_id` = "<run_id>-s<step>-p<prompt index>" and `rollout_id` = "<group_id>-<sample_idx>"
  (prompt index = `stamp.prompt_offset` + position in this call):
  unique for distinct (run_id, step, index, sample) because the numeric suffixes parse back
  unambiguously; zero-padded so byte order follows generation order.
- One row per generation, groups in prompt order, samples in group order; every row of a group
  shares prompt_id, run_id, step and policy_version, and one `created_at` (UTC, microseconds) is
  stamped on the whole table.
- `old_logprobs`/`entropies` are null unless given (scoring fills them later); when given, each
  has one float32 per response token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa

from rollstore.storage.schema import ROLLOUTS

from .backends import Generation
from .prompt_sources import Prompt
from .reward import Verdict


@dataclass(frozen=True)
class StepStamp:
    """What the rows of one generation call are labelled with: the run, the step, the policy version
    that sampled them, the index of the call's first prompt in the step (`prompt_offset`, for a step
    generated in several calls), and the creation time (timezone-aware; default: now)."""

    run_id: str
    step: int
    policy_version: int = 0
    prompt_offset: int = 0
    created_at: datetime | None = None


def make_group_id(run_id: str, step: int, prompt_index: int) -> str:
    return f"{run_id}-s{step:06d}-p{prompt_index:05d}"


def make_rollout_id(group_id: str, sample_idx: int) -> str:
    return f"{group_id}-{sample_idx:03d}"


def _list_column(rows: list, value_type: pa.DataType, np_dtype) -> pa.Array:
    """A list<value_type> array from per-row sequences; a None row becomes a null list."""
    lengths = [0 if r is None else len(r) for r in rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    present = [np.asarray(r, dtype=np_dtype) for r in rows if r is not None]
    values = np.concatenate(present) if present else np.zeros(0, dtype=np_dtype)
    mask = pa.array([r is None for r in rows], pa.bool_()) if any(r is None for r in rows) else None
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, value_type), mask=mask)


def build_rollouts(
    prompts: list[Prompt],
    generations: list[list[Generation]],
    verdicts: list[list[Verdict]],
    stamp: StepStamp,
    *,
    old_logprobs: list[list[np.ndarray]] | None = None,
    entropies: list[list[np.ndarray]] | None = None,
    meta: dict | None = None,
) -> pa.Table:
    """The rollouts table of one generation step (per-group lists, aligned with `prompts`), every
    row labelled by `stamp`; `meta` (JSON-able) goes into every row's `meta`."""
    if not (len(prompts) == len(generations) == len(verdicts)):
        raise ValueError("prompts, generations and verdicts must have one entry per prompt")
    for name, per_token in (("old_logprobs", old_logprobs), ("entropies", entropies)):
        if per_token is not None and len(per_token) != len(prompts):
            raise ValueError(f"{name} must have one entry per prompt")
    created = stamp.created_at or datetime.now(timezone.utc)
    if created.tzinfo is None:
        raise ValueError("created_at must be timezone-aware (UTC)")
    created = created.astimezone(timezone.utc)
    run_id, step, policy_version = stamp.run_id, stamp.step, stamp.policy_version

    cols: dict[str, list] = {name: [] for name in ROLLOUTS.names}
    for p_idx, (prompt, group, group_verdicts) in enumerate(zip(prompts, generations, verdicts)):
        if len(group) != len(group_verdicts):
            raise ValueError(f"prompt {p_idx}: {len(group)} generations but {len(group_verdicts)} verdicts")
        gid = make_group_id(run_id, step, stamp.prompt_offset + p_idx)
        row_meta = dict(meta or {})
        if prompt.difficulty is not None:
            row_meta["difficulty"] = prompt.difficulty
        meta_json = json.dumps(row_meta, sort_keys=True) if row_meta else None
        for k, (gen, verdict) in enumerate(zip(group, group_verdicts)):
            n_tok = len(gen.response_token_ids)
            if len(gen.gen_logprobs) != n_tok:
                raise ValueError(f"prompt {p_idx} sample {k}: gen_logprobs length != response length")
            cols["rollout_id"].append(make_rollout_id(gid, k))
            cols["group_id"].append(gid)
            cols["prompt_id"].append(prompt.prompt_id)
            cols["sample_idx"].append(k)
            cols["run_id"].append(run_id)
            cols["step"].append(step)
            cols["policy_version"].append(policy_version)
            cols["prompt"].append(prompt.prompt)
            cols["prompt_token_ids"].append(gen.prompt_token_ids)
            cols["response"].append(gen.text)
            cols["response_token_ids"].append(gen.response_token_ids)
            cols["gen_logprobs"].append(gen.gen_logprobs)
            cols["old_logprobs"].append(None if old_logprobs is None else old_logprobs[p_idx][k])
            cols["entropies"].append(None if entropies is None else entropies[p_idx][k])
            cols["finish_reason"].append(gen.finish_reason)
            cols["reward"].append(verdict.reward)
            cols["correct"].append(verdict.correct)
            cols["gold_answer"].append(prompt.gold_answer)
            cols["verify_error"].append(verdict.verify_error)
            cols["source"].append(prompt.source)
            cols["created_at"].append(created)
            cols["meta"].append(meta_json)

    arrays = []
    for field in ROLLOUTS:
        values = cols[field.name]
        if field.type == pa.list_(pa.int32()):
            arrays.append(_list_column(values, pa.int32(), np.int32))
        elif field.type == pa.list_(pa.float32()):
            arrays.append(_list_column(values, pa.float32(), np.float32))
        else:
            arrays.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(arrays, schema=ROLLOUTS)
