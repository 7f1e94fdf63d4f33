"""The trainer: curated shards → optimiser steps of a policy loss, one `training` row per step.

Invariants:
- Response token t of a row is scored by the logits at `positions[t] − 1` (the position before
  it: prompt length + t − 1), never by its own position.
- One optimiser step = `micro_batch_size × grad_accum` rows; their losses are normalised by the
  whole step's kept sequences / tokens / longest (full) response (`losses.Normalizer`, computed
  from the step's rows, `batches.RankStep.norm`), so the summed micro-batch gradients equal the
  gradient of the step's full batch, however its rows are split into micro-batches.
- Packed (`TrainConfig.pack`, the default), each row is forwarded only up to its last kept token,
  in micro-batches of rows of similar lengths, and a row with no kept token not at all
  (`batches.iter_rank_steps`): the loss and gradient are those of the whole rows with the tail
  masked (exact for a causal model; tests/test_packing.py checks it to float tolerance).
- `positions` of a step row: the positions its passes forwarded and backwarded, as run — each
  pass's padded width × rows, zero-loss passes of a rank with fewer micro-batches included, summed
  over ranks; the reference model's no-grad forward is not counted.
- A step with no kept token changes nothing (no optimiser or scheduler step) but still gets its
  metrics row (tokens 0, samples 0): nothing is silently dropped.
- bf16 autocast on CUDA only; log-softmax, entropies and losses are float32.
- No randomness inside a step; on CPU with `deterministic_cpu()` two runs from the same state give
  bit-identical weights.
- Every returned row has exactly the columns of the `training` table.
- A step whose loss or gradient norm is not finite raises `NonFiniteStep` (one line naming the
  curation, the shard and the first offending rollout_id, its log-probs judged from the step's own
  training forward, on every rank alike) before its optimiser step: nothing non-finite is ever
  applied, returned or published.
- Under `torch.distributed` (`dist`), each rank trains its share of every global step's
  micro-batches (`batches.iter_rank_steps`), the step's metrics are all-reduced, and every rank
  returns the same rows: the rows and the gradient are those of the single process (up to the
  order of float sums). `timings` gets the seconds spent reading the shards (`read`) and
  collating batches (`collate`), the store's input cost.
- The decoupled objective's π_prox (the weights at the start of the optimiser step) of a lagged
  row is the detached log-probs of the training forward of its micro-batch: the weights change
  only after every micro-batch's backward, so each forward of a step runs exactly those weights,
  and a step runs no forward besides its training passes (and the reference model's).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import random
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from rollstore.storage.errors import RollstoreError
from rollstore.storage.schema import TRAINING

from rollstore.storage.timing import Stopwatch

from .batches import Batch, iter_rank_steps, read_curated
from .parallel import Dist, grad_norm_value, sync_gradients
from .config import TrainConfig, TrainContext
from .losses import LossInputs, LossStats, Normalizer, get_loss


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


def proximal_logprobs(logp: Tensor, batch: Batch, current_version: int) -> Tensor:
    """π_prox of the decoupled objective for `batch`, from `logp`, the training forward's log-probs
    of it (the weights at the start of the optimiser step): detached `logp` for the rows sampled
    before `current_version` (lagged), their stored old log-probs, as they are, for the others (so
    a row with no lag has exactly today's loss)."""
    lagged = (batch.policy_version < current_version)[:, None]
    return torch.where(lagged, logp.detach().float(), batch.old_logprobs)


def _all_reduced(stats: LossStats, total: float, positions: int, dist: Dist) -> tuple[LossStats, float, int]:
    if not dist.active:
        return stats, total, positions
    has_entropy = stats.entropy is not None
    vals = dist.sum([total, stats.tokens, stats.samples, stats.clipped, stats.approx_kl, stats.entropy or 0.0,
                     float(has_entropy), float(positions)])
    entropy = vals[5] if vals[6] else None
    return LossStats(int(vals[1]), int(vals[2]), vals[3], vals[4], entropy, stats.ref_kl), vals[0], int(vals[7])


def train_on_curation(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    shards: Sequence[str],
    config: TrainConfig = TrainConfig(),
    *,
    run_id: str = "",
    version: int = 0,
    weights_version: int | None = None,
    start_step: int = 0,
    context: TrainContext = TrainContext(),
) -> list[dict]:
    """Train `model` on the curated Parquet files `shards` (in that order); return the step rows.

    `version` is the policy version these steps produce; `weights_version` the version the weights
    start at (default `version − 1`). With `config.loss_config.decoupled` (the default), rows
    sampled before `weights_version` get the decoupled off-policy correction (`proximal_logprobs`);
    other rows train exactly as without it. Rows are numbered `start_step + 1, ...`.
    `context.on_step(row)` is called after each optimiser step; `context.dist`: this rank (see the
    invariants). `config.lr` / `warmup_steps` are not read here (`make_optimizer` takes them).
    """
    clock = Stopwatch(context.timings)
    counts: list[int] = []
    rows_table = read_curated(shards, counts)
    clock.lap("read")
    current = version - 1 if weights_version is None else weights_version
    steps = _Steps(model, optimizer, scheduler, config, context, current, clock)
    steps.origin = _Origin(rows_table, [str(p) for p in shards], counts)
    dist = context.dist
    was_training = model.training
    model.train()
    if context.ref_model is not None:
        context.ref_model.eval()
    out: list[dict] = []
    try:
        for epoch in range(config.epochs):
            parts = iter_rank_steps(rows_table, config.micro_batch_size, config.grad_accum, config.pad_id,
                                    config.shuffle_seed, epoch, dist.rank, dist.world, pack=config.pack)
            while True:
                clock.lap("other")
                part = next(parts, None)
                clock.lap("collate")
                if part is None:
                    break
                row = steps.run(part)
                row = {"run_id": run_id, "version": int(version), "step": start_step + len(out) + 1, **row}
                row["created_at"] = dt.datetime.now(dt.timezone.utc)
                assert list(row) == TRAINING.names
                out.append(row)
                if context.on_step is not None:
                    context.on_step(row)
    finally:
        model.train(was_training)
    return out


class NonFiniteStep(RollstoreError, RuntimeError):
    """A step's loss or gradient norm is NaN or infinite: the run stops before the optimiser step
    (one line naming the curation, the shard and the first offending rollout_id)."""


class _Origin:
    """Which curated shard a row of `train_on_curation`'s table came from (for error lines)."""

    def __init__(self, table, paths: list[str], counts: list[int]):
        self.table, self.paths, self.ends = table, paths, np.cumsum(counts) if counts else np.zeros(0, np.int64)

    def shard_of(self, rollout_id: str) -> str:
        ids = self.table.column("rollout_id").to_pylist()
        if rollout_id not in ids or not len(self.ends):
            return "?"
        return self.paths[int(np.searchsorted(self.ends, ids.index(rollout_id), side="right"))]


def _first_bad_row(micro: list[Batch], logp_bad: list[Tensor]) -> tuple[str, str] | None:
    """(rollout_id, what) of the first row of `micro` whose inputs or log-probs are not finite
    (`logp_bad`: per micro-batch, which rows' log-probs were not finite in the step's own training
    forward: the weights the step ran with, on every rank alike, no forward of its own), or None."""
    with torch.no_grad():
        for b, bad_logp in zip(micro, logp_bad):
            tok = b.response_mask
            checks = [("advantage", ~torch.isfinite(b.advantage)), ("weight", ~torch.isfinite(b.weight)),
                      ("old_logprobs", (~torch.isfinite(b.old_logprobs) & tok).any(1)),
                      ("gen_logprobs", (~torch.isfinite(b.gen_logprobs) & tok).any(1)),
                      ("the model's log-probs", bad_logp)]
            for i in range(len(b)):
                for what, bad in checks:
                    if bool(bad[i]):
                        return b.rollout_ids[i], what
    return None


class _Steps:
    """One optimiser step of `train_on_curation` at a time (the objects it shares across steps)."""

    origin: _Origin | None = None

    def __init__(self, model, optimizer, scheduler, config: TrainConfig, context: TrainContext, current: int,
                 clock: Stopwatch):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.config, self.ref_model, self.dist = config, context.ref_model, context.dist
        self.current, self.clock = current, clock
        self.loss_fn = get_loss(config.loss)
        self.device = next(model.parameters()).device
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.logp_bad: list[Tensor] = []  # per micro-batch of the current step: rows whose training log-probs are not finite

    def run(self, part) -> dict:
        """Train one step's micro-batches; return its metrics row without run_id/version/step/created_at."""
        model, dist, device = self.model, self.dist, self.device
        micro = [b.to(device) for b in part.micro]
        norm = part.norm  # the whole step's, the same on every rank
        lr = float(self.optimizer.param_groups[0]["lr"])
        # which micro-batches hold a lagged row (read on the host: no device sync)
        decoupled = self.config.loss_config.decoupled
        lagged = [decoupled and bool((b.policy_version < self.current).any()) for b in part.micro]
        self.optimizer.zero_grad(set_to_none=True)
        stats, total, grad_norm, positions = LossStats(), 0.0, 0.0, 0
        self.logp_bad = []  # filled by `_loss`, read by `_check_finite` (the error line)
        if norm.tokens:
            for k in range(part.passes):
                with sync_gradients(model, dist, k == part.passes - 1):
                    if k >= len(micro):  # a zero-loss pass: the collectives of every rank line up
                        positions += part.filler.positions_run
                        logp, _ = response_logprobs(model, part.filler.to(device), with_entropy=False)
                        (logp.sum() * 0.0).backward()
                        continue
                    positions += micro[k].positions_run
                    res = self._loss(micro[k], norm, lagged[k])
                    # DDP / FSDP2 average over ranks; the global normaliser wants the sum
                    (res.loss * dist.world if dist.active else res.loss).backward()
                    total += float(res.loss.detach())
                    stats = stats + res.stats
            limit = math.inf if self.config.max_grad_norm is None else self.config.max_grad_norm
            grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(self.params, limit, foreach=False))
            self._check_finite(part, micro, total, grad_norm)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        stats, total, positions = _all_reduced(stats, total, positions, dist)
        self.optimizer.zero_grad(set_to_none=True)
        m = stats.metrics()
        return {"curation_id": ",".join(part.curation_ids) or None, "loss": total,
                "clip_fraction": m["clip_fraction"], "approx_kl": m["approx_kl"], "entropy": m["entropy"],
                "grad_norm": grad_norm, "tokens": m["tokens"], "samples": m["samples"], "lr": lr,
                "positions": positions}

    def _check_finite(self, part, micro: list[Batch], total: float, grad_norm: float) -> None:
        """Stop before the optimiser step when the step's loss or gradient norm is not finite (on
        every rank: the verdict is all-reduced), naming the curation, the shard and the first row
        whose inputs or log-probs are not finite (the step's first row when none is)."""
        bad = not (math.isfinite(total) and math.isfinite(grad_norm))
        if self.dist.active:
            bad = self.dist.sum([float(bad)])[0] > 0
        if not bad:
            return
        self.optimizer.zero_grad(set_to_none=True)
        found = _first_bad_row(micro, self.logp_bad)
        rid, what = found if found else ((micro or [part.filler])[0].rollout_ids[0], "no single row")
        shard = self.origin.shard_of(rid) if self.origin is not None else "?"
        curation = ",".join(part.curation_ids)
        raise NonFiniteStep(f"curation {curation}: {shard}: row rollout_id={rid!r}: non-finite step (loss {total}, "
                            f"grad norm {grad_norm}; first non-finite: {what}); the run stopped before this step, "
                            "nothing was published")

    def _loss(self, b: Batch, norm: Normalizer, lagged: bool):
        """The loss of micro-batch `b`; `lagged`: it holds a row sampled before the weights' version,
        whose π_prox is then this very forward's log-probs, detached (None otherwise: today's loss)."""
        logp, entropy = response_logprobs(self.model, b)
        self.logp_bad.append((~torch.isfinite(logp.detach()) & b.response_mask).any(1))  # on the device: no sync
        prox = proximal_logprobs(logp, b, self.current) if lagged else None
        ref_logp = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp, _ = response_logprobs(self.ref_model, b, with_entropy=False)
        inputs = LossInputs(logp, b.old_logprobs, b.loss_mask, b.advantage, b.weight, ref_logp=ref_logp,
                            gen_logp=b.gen_logprobs, prox_logp=prox, entropy=entropy)
        return self.loss_fn(inputs, config=self.config.loss_config, norm=norm)
