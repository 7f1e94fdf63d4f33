"""`trl-completions`: TRL GRPOTrainer's `completions/completions_{step:05d}.parquet`.

Follows the writer in TRL's `trl/trainer/grpo_trainer.py` (`GRPOTrainer.log`, when
`log_completions` is on): one Parquet file per logging step, written with pandas, with the columns
`step`, `prompt`, `completion`, one float column per reward function (named after it), optional
extra logged columns, and `advantage`; newer versions add `mode` and write under
`completions/<mode>/`. The rows come from deques that are never cleared, so a file repeats rows of
earlier files and `step` is the step the file was written at, not the step of the generation.

Invariants:
- A row's identity is its content (prompt, completion, reward columns, advantage) without the
  step: rows repeated across files (or within one) get the same rollout_id and are dropped.
- `reward` is the sum of the reward columns (TRL's reward weights are not logged: weights of 1
  are assumed and recorded); each reward column and the advantage are kept in `meta`.
- Groups are rebuilt from order (consecutive rows with the same prompt), `step` and
  `policy_version` are the file's step; both recorded as lossy.
- Rows of `mode` other than `train` are skipped.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ValidationError
from .common import Rows, TextCodec, file_time, group_ids, groups_from_order, missing, sample_idx, stable_id
from .text import fill_text

FORMAT = "trl-completions"
_NOT_REWARD = {"step", "prompt", "completion", "advantage", "mode", "image"}


def convert(path: str, codec: TextCodec | None, run_id: str) -> Rows:
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise ValidationError(path, None, None, f"{FORMAT}: not a readable Parquet file ({exc})") from None
    for name in ("prompt", "completion"):
        if name not in table.column_names:
            raise missing(FORMAT, path, name)
    data = table.to_pylist()
    if "mode" in table.column_names:
        data = [r for r in data if r.get("mode") in (None, "train")]
    reward_cols = [f.name for f in table.schema if f.name not in _NOT_REWARD
                   and (pa.types.is_floating(f.type) or pa.types.is_integer(f.type))]
    if not reward_cols:
        raise missing(FORMAT, path, "reward", "no reward function column in the file")
    rows = Rows(FORMAT, path)
    seen: set[str] = set()
    kept = []
    for r in data:
        rid = stable_id(FORMAT, r["prompt"], r["completion"], [r.get(c) for c in reward_cols], r.get("advantage"))
        if rid in seen:
            continue
        seen.add(rid)
        kept.append((rid, r))
    if len(kept) < len(data):
        rows.note("duplicated rows dropped (TRL's completion log repeats rows)")
    rows.note("reward is the sum of the reward columns (reward weights assumed 1)")
    rows.note("group rebuilt from order (consecutive rows with the same prompt)")
    rows.note("step and policy_version are the step the file was written at")
    file_step = _step(table, path)
    prompts = [r["prompt"] for _, r in kept]
    gidx = groups_from_order(prompts)
    rids = [rid for rid, _ in kept]
    gids = group_ids(FORMAT, gidx, rids)
    rows.set("rollout_id", rids)
    rows.set("group_id", gids)
    rows.set("prompt_id", [stable_id("prompt", p) for p in prompts])
    rows.set("sample_idx", sample_idx(gidx))
    rows.set("run_id", [run_id] * len(kept))
    rows.set("step", [file_step] * len(kept))
    rows.set("policy_version", [file_step] * len(kept))
    fill_text(rows, codec, prompts, [r["completion"] for _, r in kept])
    rewards = []
    for _, r in kept:
        vals = [r.get(c) for c in reward_cols]
        # TRL logs NaN for a reward function that does not apply to a sample; it adds nothing.
        rewards.append(float(sum(v for v in vals if v is not None and v == v)))
    rows.set("reward", rewards)
    rows.set("created_at", [file_time(path)] * len(kept))
    rows.extra_meta = [{"rewards": {c: r.get(c) for c in reward_cols}, "advantage": r.get("advantage")}
                       for _, r in kept]
    return rows


def _step(table: pa.Table, path: str) -> int:
    if "step" not in table.column_names or table.num_rows == 0:
        raise missing(FORMAT, path, "step")
    value = table.column("step")[0].as_py()
    try:
        return int(value)  # TRL writes it as an int (older versions: as text)
    except (TypeError, ValueError):
        raise ValidationError(path, None, "step", f"{FORMAT}: {value!r} is not a step number") from None

