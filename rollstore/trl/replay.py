"""Replay inside TRL: the stored rows a replay recipe chose from earlier batches of the run enter
`GRPOTrainer`'s batch, with the decoupled correction of learner/losses.py in TRL's own terms.

Used by `rollstore.trl.RollstoreGRPOTrainer` (its argument `tr` here) after `_apply` has written the
curated decisions of the fresh rows; one process only (the trainer refuses replay otherwise).

Invariants:
- A batch without replayed rows is never touched (the trainer calls `replay_into` only when the
  curation chose some).
- Only text batches: a batch holding a key outside `REPLAY_KEYS` is refused with one line.
- Placement: replayed rows take, in the curation's order, the slots of the fresh rows curation
  dropped (empty mask), then extend the batch; filler rows (a copy of row 0, all masked, advantage 0)
  pad it to a multiple of `steps_per_generation`. Prompts stay left-padded, completions
  right-padded (to `pad_to_multiple_of` when TRL pads so); fresh rows keep their tokens and values.
- A replayed row carries its stored token ids, the curated loss mask (in `tool_mask`, TRL's
  loss-only mask), a completion mask that is 0 when TRL masks truncated completions and the row was
  truncated, and the advantage curated advantage x the TRL scale of its own generation batch x
  weight (`stored_rows`).
- Decoupled correction: `old_per_token_logps` of a replayed row = π_prox, one no-grad forward of
  the current weights (the weights the fresh rows' old log-probs come from), so TRL's clip is
  against π_prox; the per-token weight w = min(π_prox / π_behav, cap) (π_behav = the stored
  `old_logprobs`, else `gen_logprobs`; under `importance_sampling_level="sequence"` the capped
  geometric mean over the kept tokens) is folded into a per-token (B, T) advantage. w > 0, so
  -min(ρ·wA, clip(ρ)·wA) = w · -min(ρA, clip(ρ)A) for every TRL loss.
- With a reference model (beta != 0) a replayed row's `ref_per_token_logps` is a no-grad forward of
  it; TRL's vLLM importance-sampling ratio of a replayed row comes from its stored log-probs.
- `num_items_in_batch` = the sum of completion mask x loss mask over the grown batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow.dataset as ds
import torch

from rollstore.learner import losses
from rollstore.rollout.backends import FINISH_LENGTH

from .errors import TRLPluginError

__all__ = ["REPLAY_KEYS", "decoupled_weight", "replay_into", "sampler_ratio", "stored_rows"]

# the keys of TRL's batch dict that replay knows how to grow
REPLAY_KEYS = frozenset({"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                         "num_items_in_batch", "old_per_token_logps", "sampling_per_token_logps",
                         "importance_sampling_ratio", "ref_per_token_logps", "tool_mask"})
STORED = ["rollout_id", "group_id", "sample_idx", "run_id", "step", "policy_version", "prompt_token_ids",
          "response_token_ids", "old_logprobs", "gen_logprobs", "finish_reason", "reward", "correct", "verify_error"]


def stored_rows(tr, curated: list[dict]) -> list[dict]:
    """The stored rows a replay curation chose from earlier batches of this run (main process), in
    the curation's order: tokens, behaviour log-probs (`old_logprobs`, else `gen_logprobs`), the
    sampler's log-probs, and the advantage TRL trains with (curated advantage x the TRL scale of
    the row's own group, as generated, x weight) and loss mask."""
    want = [r["rollout_id"] for r in curated]
    run_id = tr.rollstore_run_id
    with tr.rollstore_buffer.snapshot() as snap:
        snap.verify(["rollouts"])  # size, place and sha256 of what is replayed (hashed once per process)
        data = snap.arrow("rollouts")
        stored = {r["rollout_id"]: r for r in data.to_table(
            filter=ds.field("rollout_id").isin(want), columns=STORED).to_pylist()}
        steps = sorted({stored[rid]["step"] for rid in want if rid in stored})
        batches = data.to_table(  # the replayed rows' own generation batches, for TRL's scale
            filter=(ds.field("run_id") == run_id) & ds.field("step").isin(steps),
            columns=["rollout_id", "group_id", "sample_idx", "step", "reward", "correct", "verify_error"]
        ).to_pylist()
    factor: dict[str, float] = {}
    for step in steps:
        rows = sorted((r for r in batches if r["step"] == step), key=lambda r: (r["group_id"], r["sample_idx"]))
        if len(rows) % tr.num_generations:
            raise TRLPluginError(f"step {step} of run {run_id} is not whole groups of "
                                 f"num_generations={tr.num_generations}: its rows cannot be replayed in TRL")
        unscorable = [r["verify_error"] == "unscorable" for r in rows]
        rewards = torch.tensor([math.nan if u else float(r["reward"]) for r, u in zip(rows, unscorable)])
        eligible = [not u and r["correct"] is not None for r, u in zip(rows, unscorable)]
        for r, f in zip(rows, tr._scale_factors(rewards, eligible)):
            factor[r["rollout_id"]] = f
    out = []
    for row in curated:
        rid = row["rollout_id"]
        r = stored.get(rid)
        if r is None or r["run_id"] != run_id:
            raise TRLPluginError(f"curation replayed {rid}, which is not a row of run {run_id}")
        n = len(r["response_token_ids"])
        if len(row["loss_mask"]) != n:
            raise TRLPluginError(f"{rid}: curated loss_mask has {len(row['loss_mask'])} tokens, response {n}")
        behaviour = r["old_logprobs"] if r["old_logprobs"] is not None else r["gen_logprobs"]
        out.append({
            "rollout_id": rid, "step": int(r["step"]), "policy_version": int(r["policy_version"]),
            "prompt_ids": list(r["prompt_token_ids"]), "response_ids": list(r["response_token_ids"]),
            "behaviour": list(behaviour), "gen": list(r["gen_logprobs"]), "finish": r["finish_reason"],
            "advantage": float(row["advantage"]) * factor[rid] * float(row["weight"]),
            "mask": [int(m) for m in row["loss_mask"]],
        })
    return out


@dataclass(frozen=True)
class _Layout:
    """Where replayed rows go: the batch is (B, P) prompts and (B, C) completions before, (B2, P2)
    and (B2, C2) after; replayed row k sits at row `positions[k]`."""

    B: int
    P: int
    C: int
    B2: int
    P2: int
    C2: int
    positions: list[int]


def _layout(tr, output, masks: list[list[int]], replayed: list[dict]) -> _Layout:
    B, P = output["prompt_ids"].shape
    C = output["completion_ids"].size(1)
    slots = [i for i in range(B) if not masks[i]]  # fresh rows curation dropped
    extra = max(0, len(replayed) - len(slots))
    fillers = (-(B + extra)) % int(tr.args.steps_per_generation)
    P2 = max([P] + [len(r["prompt_ids"]) for r in replayed])
    C2 = max([C] + [len(r["response_ids"]) for r in replayed])
    multiple = getattr(tr, "pad_to_multiple_of", None)
    if multiple:
        C2 = -(-C2 // multiple) * multiple
    positions = (slots + list(range(B, B + extra)))[:len(replayed)]
    return _Layout(B, P, C, B + extra + fillers, P2, C2, positions)


def _grow(x: torch.Tensor, rows: int, width: int, value, left: bool = False) -> torch.Tensor:
    """(B, w) -> (rows, width): padded on the right (left for prompts); new rows are `value`."""
    out = torch.full((rows, width), value, dtype=x.dtype, device=x.device)
    if left:
        out[:x.size(0), width - x.size(1):] = x
    else:
        out[:x.size(0), :x.size(1)] = x
    return out


def _grown_batch(output, old: torch.Tensor, lay: _Layout, pad_id: int) -> dict:
    """TRL's batch tensors grown to the layout's shape; filler rows copy row 0 (masked by the loss)."""
    B2, P2, C2 = lay.B2, lay.P2, lay.C2
    new = {
        "prompt_ids": _grow(output["prompt_ids"], B2, P2, pad_id, left=True),
        "prompt_mask": _grow(output["prompt_mask"], B2, P2, 0, left=True),
        "completion_ids": _grow(output["completion_ids"], B2, C2, pad_id),
        "completion_mask": _grow(output["completion_mask"], B2, C2, 0),
        "old_per_token_logps": _grow(old.detach(), B2, C2, 0.0),
        "tool_mask": _grow(output["tool_mask"], B2, C2, 0),
    }
    for key in ("sampling_per_token_logps", "importance_sampling_ratio", "ref_per_token_logps"):
        if output.get(key) is not None:
            x = output[key]
            new[key] = _grow(x, B2, C2, 0.0) if x.size(1) == lay.C else torch.cat(  # sequence-level ratio: (B, 1)
                [x, x.new_zeros(B2 - lay.B, x.size(1))])
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "old_per_token_logps"):
        new[key][lay.B:] = new[key][0]
    return new


def _place(new: dict, lay: _Layout, replayed: list[dict], pad_id: int, mask_truncated: bool) -> torch.Tensor:
    """Write each replayed row's tokens, masks and sampler log-probs at its position; returns their
    behaviour log-probs, (len(replayed), C2) float32, zero past each response."""
    P2 = lay.P2
    behaviour = torch.zeros(len(replayed), lay.C2, dtype=torch.float32, device=new["completion_ids"].device)
    for k, (pos, r) in enumerate(zip(lay.positions, replayed)):
        p, n = len(r["prompt_ids"]), len(r["response_ids"])
        new["prompt_ids"][pos] = pad_id
        new["prompt_ids"][pos, P2 - p:] = torch.tensor(r["prompt_ids"], dtype=new["prompt_ids"].dtype)
        new["prompt_mask"][pos] = 0
        new["prompt_mask"][pos, P2 - p:] = 1
        new["completion_ids"][pos] = pad_id
        new["completion_ids"][pos, :n] = torch.tensor(r["response_ids"], dtype=new["completion_ids"].dtype)
        truncated = mask_truncated and r["finish"] == FINISH_LENGTH
        new["completion_mask"][pos] = 0
        new["completion_mask"][pos, :n] = 0 if truncated else 1
        new["tool_mask"][pos] = 0
        new["tool_mask"][pos, :n] = torch.tensor(r["mask"], dtype=new["tool_mask"].dtype)
        behaviour[k, :n] = torch.tensor(r["behaviour"], dtype=torch.float32)
        if "sampling_per_token_logps" in new:
            new["sampling_per_token_logps"][pos] = 0.0
            new["sampling_per_token_logps"][pos, :n] = torch.tensor(r["gen"], dtype=torch.float32)
    return behaviour


def _forward(tr, new: dict, idx: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """π_prox of the replayed rows (the weights this generation batch trains from) and, when the
    batch has reference log-probs, the reference model's; both no-grad."""
    ids = torch.cat([new["prompt_ids"][idx], new["completion_ids"][idx]], dim=1)
    attn = torch.cat([new["prompt_mask"][idx], new["completion_mask"][idx]], dim=1)
    size = tr.args.per_device_train_batch_size
    with torch.no_grad():
        prox, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, attn, width, batch_size=size)
        ref = None
        if "ref_per_token_logps" in new:
            ref, _, _ = tr._get_per_token_logps_and_entropies(tr.ref_model, ids, attn, width, batch_size=size)
    return prox, ref


def decoupled_weight(prox: torch.Tensor, behaviour: torch.Tensor, keep: torch.Tensor, cap: float,
                     sequence: bool) -> torch.Tensor:
    """min(π_prox / π_behav, cap) per token, (B, T): `learner.losses.decoupled_weight`, the
    sequence-level weight (`sequence`) expanded over the row's tokens."""
    w = losses.decoupled_weight(prox, behaviour, keep, cap, sequence=sequence)
    return w[:, None].expand(-1, keep.size(1)) if sequence else w


def sampler_ratio(tr, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio (trainer vs sampler log-probs, per the trainer's
    `vllm_importance_sampling_mode`) for replayed rows, from their stored log-probs."""
    diff = torch.nan_to_num((trainer_logps - sampler_logps) * mask, nan=0.0)
    mode = tr.vllm_importance_sampling_mode
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    lo, hi = tr.vllm_importance_sampling_clip_min, tr.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    bad = (ratio < (-math.inf if lo is None else lo)) | (ratio > (math.inf if hi is None else hi))
    return ratio.masked_fill(bad, 0.0)


def replay_into(tr, output: dict, decision: dict) -> None:
    """Put `decision["replayed"]` (from `stored_rows`) into TRL's batch dict `output`, in place, and
    record on `tr` what the batch now holds: `rollstore_last_rows` (per row its rollout id, None for
    a filler), `rollstore_last_replayed`, `rollstore_last_advantages` (per row, before the decoupled
    weight) and `rollstore_last_replay_weights` (per replayed row, per token)."""
    unknown = sorted(k for k, v in output.items() if v is not None and k not in REPLAY_KEYS)
    if unknown:
        raise TRLPluginError(f"replay into TRL's batch supports text-only batches; this batch has {unknown}")
    replayed = decision["replayed"]
    lay = _layout(tr, output, decision["masks"], replayed)
    B, B2, C2 = lay.B, lay.B2, lay.C2
    device = output["completion_ids"].device
    pad_id = getattr(tr, "_tokenizer", tr.processing_class).pad_token_id
    old = output.get("old_per_token_logps")
    if old is None:
        old = tr._rollstore_own_logps  # the fresh rows' no-grad forward with the current weights
    new = _grown_batch(output, old, lay, pad_id)
    fresh_adv = output["advantages"]
    advantages = torch.zeros(B2, C2, dtype=fresh_adv.dtype, device=device)
    advantages[:B] = fresh_adv[:, None].expand(B, C2)  # `_apply` wrote one advantage per row
    behaviour = _place(new, lay, replayed, pad_id, tr.mask_truncated_completions)
    idx = torch.tensor(lay.positions, device=device)
    prox, ref = _forward(tr, new, idx, C2)
    keep = new["tool_mask"][idx].bool() & new["completion_mask"][idx].bool()
    weight = decoupled_weight(prox, behaviour, keep, tr.rollstore_cap, tr.importance_sampling_level == "sequence")
    new["old_per_token_logps"][idx] = prox.to(new["old_per_token_logps"].dtype)
    if ref is not None:
        new["ref_per_token_logps"][idx] = ref.to(new["ref_per_token_logps"].dtype)
    if "importance_sampling_ratio" in new:  # TRL's sampler/trainer correction, from the stored log-probs
        gen = new["sampling_per_token_logps"][idx] if "sampling_per_token_logps" in new else behaviour
        new["importance_sampling_ratio"][idx] = sampler_ratio(tr, behaviour, gen, keep).to(
            new["importance_sampling_ratio"].dtype)
    row_adv = torch.tensor([r["advantage"] for r in replayed], dtype=advantages.dtype, device=device)
    advantages[idx] = row_adv[:, None] * weight.to(advantages.dtype)
    new["advantages"] = advantages
    new["num_items_in_batch"] = (new["completion_mask"] * new["tool_mask"]).sum()
    for key in list(output):
        if key not in new:
            del output[key]
    output.update(new)
    rows_ids: list[str | None] = list(tr.rollstore_last_ids) + [None] * (B2 - B)
    tr.rollstore_last_advantages = [float(a) for a in fresh_adv.tolist()] + [0.0] * (B2 - B)
    for pos, r in zip(lay.positions, replayed):
        rows_ids[pos] = r["rollout_id"]
        tr.rollstore_last_advantages[pos] = r["advantage"]
    tr.rollstore_last_rows = rows_ids
    tr.rollstore_last_replayed = [r["rollout_id"] for r in replayed]
    tr.rollstore_last_replay_weights = weight.detach().cpu()
