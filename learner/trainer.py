"""The trainer: curated shards → optimiser steps of a policy loss, one `training` row per step.

Invariants:
- Response token t of a row is scored by the logits at `positions[t] − 1` (the position before
  it: prompt length + t − 1), never by its own position.
- One optimiser step = `grad_accum` micro-batches; their losses are normalised by the whole
  step's kept sequences / tokens / longest response (`losses.Normalizer`), so the summed
  micro-batch gradients equal the gradient of the step's full batch.
- A step with no kept token changes nothing (no optimiser or scheduler step) but still gets its
  metrics row (tokens 0, samples 0): nothing is silently dropped.
- bf16 autocast on CUDA only; log-softmax, entropies and losses are float32.
- No randomness inside a step; on CPU with `deterministic_cpu()` two runs from the same state give
  bit-identical weights.
- Every returned row has exactly the columns of the `training` table.
- Under `torch.distributed` (`dist`), each rank trains its block of every global step
  (`batches.iter_rank_steps`), the step's `Normalizer` and metrics are all-reduced, and every rank
  returns the same rows: the rows and the gradient are those of the single process (up to the
  order of float sums). `timings` gets the seconds spent reading the shards (`read`) and
  collating batches (`collate`), the store's input cost, and the decoupled objective's proximal
  forward (`proximal`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import random
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from storage.schema import TRAINING

from storage.timing import Stopwatch

from .batches import Batch, iter_rank_steps, read_curated
from .distributed import SINGLE, Dist, grad_norm_value, sync_gradients
from .losses import LossConfig, LossStats, Normalizer, get_loss


def deterministic_cpu(seed: int = 0, threads: int = 1) -> None:
    """Seed every RNG, force deterministic kernels and a fixed thread count (CPU reproducibility)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


class WarmupConstant:
    """LR multiplier: linear warm-up over `warmup_steps` optimiser steps, then constant 1."""

    def __init__(self, warmup_steps: int):
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step: int) -> float:
        return 1.0 if self.warmup_steps <= 0 else min(1.0, (step + 1) / self.warmup_steps)


def make_optimizer(
    model: torch.nn.Module,
    lr: float = 1e-6,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    warmup_steps: int = 0,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters + a linear warm-up schedule (state_dict-able)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, WarmupConstant(warmup_steps))


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def response_logprobs(model, batch: Batch, with_entropy: bool = True) -> tuple[Tensor, Tensor | None]:
    """(log π(response token) [B, T] float32 with grad, entropy [B, T] float32 without grad)."""
    device = batch.input_ids.device
    with _autocast(device):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    index = (batch.positions - 1).clamp(min=0)  # logits at p − 1 predict the token at p
    picked = logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))
    logprobs = torch.log_softmax(picked.float(), dim=-1)
    logp = logprobs.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logprobs.exp() * logprobs).sum(dim=-1)
    return logp, entropy


def proximal_logprobs(model, batch: Batch, current_version: int, whole: bool = False) -> Tensor:
    """π_prox of the decoupled objective for `batch`: the model's log-probs now (no grad) for the
    rows sampled before `current_version` (lagged), their stored old log-probs for the others (so
    a row with no lag has exactly today's loss). Only lagged rows are run through the model, unless
    `whole` (under torch.distributed every rank runs one forward per pass, whatever its rows)."""
    lagged = batch.policy_version < current_version
    prox = batch.old_logprobs.clone()
    if whole or bool(lagged.any()):
        with torch.no_grad():
            logp, _ = response_logprobs(model, batch if whole else batch.rows(lagged), with_entropy=False)
        prox[lagged] = (logp[lagged] if whole else logp).float()
    return prox


def _proximal(model, part, micro: list[Batch], current: int, dist: Dist, device) -> list[Tensor | None]:
    """π_prox of each micro-batch of one optimiser step (None where no row is lagged). Under
    torch.distributed the forwards are collectives (FSDP2 gathers the weights, DDP may broadcast
    buffers): when any rank has a lagged row, every rank runs one forward per pass of the step,
    the zero-loss passes included, so that the collectives line up."""
    lagged = any(bool((b.policy_version < current).any()) for b in micro)
    if dist.active:
        lagged = dist.sum([float(lagged)])[0] > 0
    if not lagged:
        return [None] * len(micro)
    prox = [proximal_logprobs(model, b, current, whole=dist.active) for b in micro]
    if dist.active:
        for _ in range(part.passes - len(micro)):
            with torch.no_grad():
                response_logprobs(model, part.filler.to(device), with_entropy=False)
    return prox


def _all_reduced(stats: LossStats, total: float, dist: Dist) -> tuple[LossStats, float]:
    if not dist.active:
        return stats, total
    has_entropy = stats.entropy is not None
    vals = dist.sum([total, stats.tokens, stats.samples, stats.clipped, stats.approx_kl, stats.entropy or 0.0,
                     float(has_entropy)])
    entropy = vals[5] if vals[6] else None
    return LossStats(int(vals[1]), int(vals[2]), vals[3], vals[4], entropy, stats.ref_kl), vals[0]


def train_on_curation(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    shards: Sequence[str],
    *,
    loss: str = "grpo",
    epochs: int = 1,
    micro_batch_size: int = 8,
    grad_accum: int = 1,
    max_grad_norm: float | None = 1.0,
    loss_config: LossConfig = LossConfig(),
    ref_model: torch.nn.Module | None = None,
    pad_id: int = 0,
    shuffle_seed: int | None = None,
    run_id: str = "",
    version: int = 0,
    start_step: int = 0,
    on_step: Callable[[dict], None] | None = None,
    dist: Dist = SINGLE,
    timings: dict[str, float] | None = None,
    weights_version: int | None = None,
) -> list[dict]:
    """Train `model` on the curated Parquet files `shards` (in that order); return the step rows.

    `version` is the policy version these steps produce; `weights_version` the version the weights
    start at (default `version − 1`). With `loss_config.decoupled` (the default), rows sampled
    before `weights_version` get the decoupled off-policy correction (`proximal_logprobs`); other
    rows train exactly as without it. Rows are numbered `start_step + 1, ...`.
    `on_step(row)` is called after each optimiser step. `dist`: this rank (see the invariants).
    """
    loss_fn = get_loss(loss)
    current = version - 1 if weights_version is None else weights_version
    device = next(model.parameters()).device
    clock = Stopwatch(timings)
    rows_table = read_curated(shards)
    clock.lap("read")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    was_training = model.training
    model.train()
    if ref_model is not None:
        ref_model.eval()
    out: list[dict] = []
    step = start_step
    try:
        for epoch in range(epochs):
            steps = iter_rank_steps(rows_table, micro_batch_size, grad_accum, pad_id, shuffle_seed, epoch,
                                    dist.rank, dist.world)
            while True:
                clock.lap("other")
                part = next(steps, None)
                clock.lap("collate")
                if part is None:
                    break
                micro = [b.to(device) for b in part.micro]
                norm = Normalizer(0, 0, 0)
                for b in micro:
                    norm = norm + Normalizer.of(b.loss_mask, b.lengths)
                norm = dist.normalizer(norm)
                lr = float(optimizer.param_groups[0]["lr"])
                # π_prox: the weights at the start of this optimiser step, before its first backward
                clock.lap("other")
                prox = (_proximal(model, part, micro, current, dist, device) if loss_config.decoupled
                        else [None] * len(micro))
                clock.lap("proximal")
                optimizer.zero_grad(set_to_none=True)
                stats, total = LossStats(), 0.0
                if norm.tokens:
                    for k in range(part.passes):
                        last = k == part.passes - 1
                        with sync_gradients(model, dist, last):
                            if k >= len(micro):  # a zero-loss pass: the collectives of every rank line up
                                logp, _ = response_logprobs(model, part.filler.to(device), with_entropy=False)
                                (logp.sum() * 0.0).backward()
                                continue
                            b = micro[k]
                            logp, entropy = response_logprobs(model, b)
                            ref_logp = None
                            if ref_model is not None:
                                with torch.no_grad():
                                    ref_logp, _ = response_logprobs(ref_model, b, with_entropy=False)
                            res = loss_fn(
                                logp, b.old_logprobs, b.loss_mask, b.advantage, b.weight,
                                config=loss_config, norm=norm, ref_logp=ref_logp,
                                gen_logp=b.gen_logprobs, entropy=entropy, prox_logp=prox[k],
                            )
                            # DDP / FSDP2 average over ranks; the global normaliser wants the sum
                            (res.loss * dist.world if dist.active else res.loss).backward()
                            total += float(res.loss.detach())
                            stats = stats + res.stats
                    limit = math.inf if max_grad_norm is None else max_grad_norm
                    grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(params, limit, foreach=False))
                    optimizer.step()
                    if scheduler is not None:
                        scheduler.step()
                else:
                    grad_norm = 0.0
                stats, total = _all_reduced(stats, total, dist)
                optimizer.zero_grad(set_to_none=True)
                step += 1
                m = stats.metrics()
                row = {
                    "run_id": run_id,
                    "version": int(version),
                    "step": step,
                    "curation_id": ",".join(part.curation_ids) or None,
                    "loss": total,
                    "clip_fraction": m["clip_fraction"],
                    "approx_kl": m["approx_kl"],
                    "entropy": m["entropy"],
                    "grad_norm": grad_norm,
                    "tokens": m["tokens"],
                    "samples": m["samples"],
                    "lr": lr,
                    "created_at": dt.datetime.now(dt.timezone.utc),
                }
                assert list(row) == TRAINING.names
                out.append(row)
                if on_step is not None:
                    on_step(row)
    finally:
        model.train(was_training)
    return out
