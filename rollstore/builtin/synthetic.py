"""Generated rollouts in the rollouts schema, for tests, benchmarks and the quick demo.

Invariants: deterministic in `seed`; every table passes `storage.validate.validate_rollouts`;
prompts have a hidden success rate so that groups span all-wrong to all-correct.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from rollstore.storage.schema import ROLLOUTS

EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


@dataclass(frozen=True)
class RowOptions:
    """The rarely changed knobs of `rollouts_table`: the share of rows without a verdict
    (`p_invalid`) and of truncated ones (`p_truncated`), whether the `entropies` and `old_logprobs`
    columns are filled (else null), and the prefix of group and rollout ids (default
    "<run_id>-s<step>")."""

    p_invalid: float = 0.02
    p_truncated: float = 0.05
    with_entropies: bool = True
    with_old_logprobs: bool = True
    id_prefix: str | None = None


def rollouts_table(
    n_groups: int = 16,
    group_size: int = 8,
    mean_tokens: int = 32,
    seed: int = 0,
    run_id: str = "run0",
    step: int = 0,
    policy_version: int = 0,
    n_prompts: int | None = None,
    options: RowOptions = RowOptions(),
) -> pa.Table:
    """One step of a run: n_groups groups of group_size responses each."""
    o = options
    rng = np.random.default_rng([seed, step, policy_version])
    n_prompts = n_prompts or max(1, n_groups)
    prefix = o.id_prefix or f"{run_id}-s{step}"
    success = np.random.default_rng(seed).beta(0.6, 0.6, size=n_prompts)  # per-prompt, fixed by seed
    n = n_groups * group_size
    lengths = np.maximum(1, rng.poisson(mean_tokens, size=n)).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(offsets[-1])
    tokens = rng.integers(3, 30, size=total, dtype=np.int32)
    gen_lp = -rng.exponential(0.4, size=total).astype(np.float32)
    old_lp = np.minimum(0, gen_lp + rng.normal(0, 0.01, size=total)).astype(np.float32)
    ent = rng.gamma(1.5, 0.5, size=total).astype(np.float32)
    prompt_of_group = rng.integers(0, n_prompts, size=n_groups)
    rows_prompt = np.repeat(prompt_of_group, group_size)
    correct = rng.random(n) < success[rows_prompt]
    invalid = rng.random(n) < o.p_invalid
    truncated = rng.random(n) < o.p_truncated
    reward = correct.astype(np.float32)
    created = EPOCH + dt.timedelta(seconds=step * 60 + policy_version * 3600)

    def lists(values, dtype):
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, dtype))

    gid = [f"{prefix}-g{g}" for g in range(n_groups)]
    cols = {
        "rollout_id": pa.array([f"{prefix}-g{i // group_size}-{i % group_size}" for i in range(n)]),
        "group_id": pa.array([gid[i // group_size] for i in range(n)]),
        "prompt_id": pa.array([f"p{p}" for p in rows_prompt]),
        "sample_idx": pa.array(np.arange(n) % group_size, pa.int32()),
        "run_id": pa.array([run_id] * n),
        "step": pa.array(np.full(n, step), pa.int64()),
        "policy_version": pa.array(np.full(n, policy_version), pa.int64()),
        "prompt": pa.array([f"prompt {p}" for p in rows_prompt]),
        "prompt_token_ids": pa.array([[1, 2, int(p) % 30] for p in rows_prompt], pa.list_(pa.int32())),
        "response": pa.array([f"answer {i}" for i in range(n)]),
        "response_token_ids": lists(tokens, pa.int32()),
        "gen_logprobs": lists(gen_lp, pa.float32()),
        "old_logprobs": lists(old_lp, pa.float32()) if o.with_old_logprobs else pa.nulls(n, pa.list_(pa.float32())),
        "entropies": lists(ent, pa.float32()) if o.with_entropies else pa.nulls(n, pa.list_(pa.float32())),
        "finish_reason": pa.array(np.where(truncated, "length", "stop").tolist()),
        "reward": pa.array(reward, pa.float32()),
        "correct": pa.array([None if inv else bool(c) for inv, c in zip(invalid, correct)], pa.bool_()),
        "gold_answer": pa.array(["42"] * n),
        "verify_error": pa.array(["unparsable answer" if inv else None for inv in invalid], pa.string()),
        "source": pa.array(["synthetic"] * n),
        "created_at": pa.array([created] * n, pa.timestamp("us", tz="UTC")),
        "meta": pa.nulls(n, pa.string()),
    }
    return pa.Table.from_pydict(cols, schema=ROLLOUTS)
