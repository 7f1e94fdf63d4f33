"""What a training call is told: the configuration (`TrainConfig`), where the run is
(`RunPosition`), which pending shards to train (`Pending`) and what the caller plugs in
(`TrainContext`).

Invariants:
- `TrainConfig` and `RunPosition` are frozen values: two calls with equal ones (and the same
  model, optimiser state and shards) train the same steps.
- The defaults are those the learner's functions had as keyword arguments; a caller (the CLI, the
  loop) overrides only what it sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from rollstore.storage.manifest import Shard

from .parallel import SINGLE, Dist
from .losses import LossConfig


@dataclass(frozen=True)
class TrainConfig:
    """How to train: the loss, the batches and the optimiser (see `trainer.train_on_curation`).

    One optimiser step is `micro_batch_size` × `grad_accum` rows (the global batch, whatever the
    number of ranks); `lr` / `warmup_steps` are what `make_optimizer` is built with."""

    loss: str = "grpo"
    loss_config: LossConfig = LossConfig()
    epochs: int = 1
    micro_batch_size: int = 8
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    shuffle_seed: int | None = None
    pad_id: int = 0
    lr: float = 1e-6
    warmup_steps: int = 0
    # Rows trimmed after their last kept token and micro-batched by length (`batches.iter_rank_steps`);
    # False: every row whole, in the loader's order (the learner's work before packing, to compare).
    pack: bool = True


@dataclass(frozen=True)
class RunPosition:
    """Where a run is: its id, the version its weights are at and the global optimiser step
    reached (what `consume.resume` returns)."""

    run_id: str
    version: int = 0
    step: int = 0


@dataclass(frozen=True)
class Pending:
    """Which pending curated shards to train: all live ones, those of `curation_ids`, or the
    given `shards` (a lease's, acked with `lease=(consumer, group)` when published); one
    checkpoint per shard (`per="shard"`) or per curation (`per="curation"`)."""

    curation_ids: Sequence[str] | None = None
    shards: Sequence[Shard] | None = None
    lease: tuple[str, str] | None = None
    per: str = "shard"


@dataclass
class TrainContext:
    """What the caller plugs in besides the configuration: this torch.distributed rank, a
    callback after each optimiser step, a dict that gets the seconds of each phase, and a
    frozen reference model for the KL term (`LossConfig.kl_beta`)."""

    dist: Dist = field(default_factory=lambda: SINGLE)
    on_step: Callable[[dict], None] | None = None
    timings: dict[str, float] | None = None
    ref_model: object | None = None
