"""torch.distributed for the learner: the process group, the rank split of a global batch, global
reductions, DDP / FSDP2 wrapping, and the full (unsharded) state rank 0 publishes.

One global step is what the single-process learner calls a step: `micro_batch_size × grad_accum`
rows in the loader's order. Its micro-batches (`batches.iter_rank_steps`: packed by length) are dealt
to the ranks in turn, and the step's losses are normalised by the whole step's counts (which every
rank computes from the same table), so the summed gradient is the single-process gradient of the
same rows.

Invariants:
- `SINGLE` (world 1, no process group) is the identity: no collective, no scaling, no wrapper;
  the single-process learner is exactly what it was.
- `rank_micro(n, rank, world)` is micro-batches `rank, rank + world, ...` of a step's n: the
  shares are disjoint, cover the n, and depend only on n and the world size (never on timing or on
  which rank reads the files first). Dealt in turn, a step's micro-batches sorted by length give
  every rank a similar amount of work.
- Every rank runs `passes(n, world)` forward/backward passes per step — the most any rank needs —
  padding with zero-loss passes, so every collective inside DDP / FSDP2 lines up.
- DDP and FSDP2 average gradients over ranks; each rank's loss is multiplied by the world size
  (exact for powers of two) so that the reduced gradient is the *sum* the global normaliser expects.
- The backend follows the device: NCCL on CUDA, gloo on CPU.
- Checkpoints hold full, unsharded weights and an optimizer state keyed like a single-process
  `optimizer.state_dict()`: a run resumes with any number of ranks, or with none.
"""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch

PARALLEL = ("none", "ddp", "fsdp")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_micro(n: int, rank: int, world: int) -> range:
    """This rank's micro-batches of a step of n: `rank, rank + world, ...` (disjoint, covering)."""
    return range(rank, n, world)


def passes(n: int, world: int) -> int:
    """Forward/backward passes every rank runs for a step of n micro-batches (the most any rank needs)."""
    return -(-n // world)


@dataclass
class Dist:
    """Where this process sits: rank, world size, the wrapper (`none`/`ddp`/`fsdp`), its device."""

    rank: int = 0
    world: int = 1
    parallel: str = "none"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    shadow: Any = None  # FSDP2, rank 0: an unsharded CPU copy of the model for save_pretrained

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    # ---- collectives (identity when single) ---------------------------------------------------

    def sum(self, values: list[float]) -> list[float]:
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return t.tolist()

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()


SINGLE = Dist()


def init(parallel: str = "ddp", device: torch.device | None = None) -> Dist:
    """Join (or start) the process group described by torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, ...); without it, or with `parallel="none"`, the single process."""
    if parallel not in PARALLEL:
        raise ValueError(f"--parallel must be one of {', '.join(PARALLEL)}, not {parallel!r}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if parallel == "none" or (world == 1 and not torch.distributed.is_initialized()):
        return Dist(device=device or torch.device("cpu"))
    if device is None:
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend_for(device))
    return current(parallel, device)


def current(parallel: str, device: torch.device | None = None) -> Dist:
    """The Dist of an already initialised process group."""
    return Dist(torch.distributed.get_rank(), torch.distributed.get_world_size(), parallel,
                device or torch.device("cpu"))


def close(dist: Dist) -> None:
    """Leave the group together (rank 0 hosts the rendezvous store: it must not leave first)."""
    if dist.active and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


# ---- wrapping -------------------------------------------------------------------------------


def _blocks(model) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    return list(getattr(inner, "layers", []) or [])


def wrap(model, optimizer, scheduler, dist: Dist):
    """(model, optimizer) ready for training under `dist`, after `resume` filled the plain ones.

    DDP wraps the model (the optimizer keeps its parameters). FSDP2 shards every decoder layer and
    the root in place, builds the same optimizer over the sharded parameters and loads the plain
    optimizer's state into it; the scheduler is pointed at the new optimizer.
    """
    if not dist.active or dist.parallel == "none":
        return model, optimizer
    if dist.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [dist.device.index] if dist.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids), optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    full_osd = _by_name(optimizer.state_dict(), model)
    dist.shadow = copy.deepcopy(model).to("cpu") if dist.is_main else None
    for block in _blocks(model):
        fully_shard(block)
    fully_shard(model)
    accepted = inspect.signature(type(optimizer)).parameters
    hyper = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    new = type(optimizer)([p for p in model.parameters() if p.requires_grad], **hyper)
    for fresh, old in zip(new.param_groups, optimizer.param_groups):  # lr, initial_lr (the scheduler's)
        fresh.update({k: v for k, v in old.items() if k != "params"})
    if optimizer.state:  # torch 2.13: loading an empty full state corrupts the first AdamW steps
        set_optimizer_state_dict(model, new, full_osd, options=StateDictOptions(full_state_dict=True))
    if scheduler is not None:
        scheduler.optimizer = new
    return model, new


def _trainable_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _by_name(osd: dict, model) -> dict:
    """A single-process optimizer state (keyed by parameter index) keyed by parameter name."""
    names = _trainable_names(model)
    return {
        "state": {names[i]: s for i, s in osd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]],
    }


def _by_index(osd: dict, model) -> dict:
    index = {n: i for i, n in enumerate(_trainable_names(model))}
    return {
        "state": {index[n]: s for n, s in osd["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]],
    }


class _StateOnly:
    """Quacks like an optimizer for `save_checkpoint`: only `state_dict()`."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def publishable(model, optimizer, dist: Dist):
    """(plain model, optimizer-like) whose `save_pretrained` / `state_dict()` are the full state, on
    rank 0; None on the other ranks. Collective under FSDP2 (every rank must call it)."""
    if not dist.active or dist.parallel == "none":
        return model, optimizer
    if dist.parallel == "ddp":
        return (model.module, optimizer) if dist.is_main else None
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    if not dist.is_main:
        return None
    dist.shadow.load_state_dict(weights)
    return dist.shadow, _StateOnly(_by_index(osd, dist.shadow))


def sync_gradients(model, dist: Dist, last: bool):
    """Context for one backward pass: DDP reduces gradients only on a step's last pass."""
    import contextlib

    if dist.active and dist.parallel == "ddp" and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def grad_norm_value(norm) -> float:
    """A clip_grad_norm_ result as a float (FSDP2 returns a DTensor)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)
