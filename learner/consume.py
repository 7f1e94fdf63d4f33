"""Exactly-once consumption of curated shards: train each pending unit once, then checkpoint it.

A unit is one curated shard (`per="shard"`) or all pending shards of one curation
(`per="curation"`). After each unit, one checkpoint is published whose `consumed` is exactly that
unit's shards, together with the unit's `training` rows, in one manifest commit.

Invariants:
- A shard is pending iff it is a live `curated` shard (of `curation_ids`, when given) that is not
  in the consumed ledger of the version the model is at (`from_version`'s lineage).
- Units go in manifest commit order (shard id), so an interrupted run resumed from its latest
  checkpoint (`resume`) trains exactly the units it had not published, in the same order, from
  the same optimizer / scheduler / RNG state: the result equals an uninterrupted run.
- Every pending unit's curated shards and the rollouts shards they refer to are verified (size,
  place, sha256: `storage.verify.verify_training_inputs`) before the first unit is trained.
- Every pending unit's advantages, weights and log-probs are checked finite, and its token ids are
  checked against the model's vocabulary before the first unit
  is trained: a row the model cannot embed is one line naming it, and nothing is published.
- A unit is never trained twice into a run even if callers misuse this module: `save_checkpoint`
  refuses a shard already consumed by the run inside its commit transaction.
- Under `torch.distributed` (`dist`), rank 0 decides (the pending units, each new version) and
  broadcasts it; every rank trains its block of each step; rank 0 alone publishes the checkpoint
  (full weights, ledger, training rows and lease acks in one manifest commit, as above) and its
  outcome is broadcast, so every rank moves on or fails together. A checkpoint holds the full,
  unsharded state: a run resumes with the same or any other number of ranks.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Iterable, Sequence

from rollstore.storage.buffer import Buffer
from rollstore.storage.manifest import Shard
from rollstore.storage.timing import Stopwatch
from rollstore.storage.verify import verify_training_inputs

from .batches import check_vocabulary
from .checkpoint import (
    Checkpoint,
    CheckpointError,
    Publish,
    consumed_entry,
    consumed_in_lineage,
    get_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from .config import Pending, RunPosition, TrainConfig, TrainContext
from .parallel import publishable
from .trainer import train_on_curation


def vocabulary_size(model) -> int | None:
    """Rows of the model's input embedding (through a DDP/FSDP wrapper), or None if it has none."""
    inner = getattr(model, "module", model)
    get = getattr(inner, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    return getattr(emb, "num_embeddings", None)


def shard_curation_id(shard: Shard) -> str:
    """The curation of a curated shard: its manifest key, else its folder (curated/<id>/...)."""
    return shard.key or os.path.basename(os.path.dirname(shard.path))


def pending_shards(
    buf: Buffer,
    ledger: Iterable[dict] = (),
    curation_ids: Sequence[str] | None = None,
    shards: Sequence[Shard] | None = None,
) -> list[Shard]:
    """Live curated shards (or the given ones, e.g. a lease's) not in `ledger`, in commit order."""
    done = {e["shard"] for e in ledger}
    pool = list(shards) if shards is not None else buf.manifest.shards("curated")
    wanted = None if curation_ids is None else set(curation_ids)
    out = [
        s for s in pool
        if s.path not in done and (wanted is None or shard_curation_id(s) in wanted)
    ]
    return sorted(out, key=lambda s: s.shard_id)


def resume(
    buf: Buffer, model, optimizer, scheduler, run_id: str, base_version: int = 0
) -> tuple[int, int]:
    """Restore the run's latest checkpoint into the objects; return (version, global step).

    Without a checkpoint of the run nothing is touched and (base_version, 0) is returned.
    """
    ck = latest_checkpoint(buf, run_id)
    if ck is None:
        return base_version, 0
    ck = load_checkpoint(buf, model, optimizer, scheduler, version=ck.version)
    return ck.version, ck.step


def _units(shards: list[Shard], per: str) -> list[list[Shard]]:
    if per == "shard":
        return [[s] for s in shards]
    if per == "curation":
        groups: dict[str, list[Shard]] = {}
        for s in shards:
            groups.setdefault(shard_curation_id(s), []).append(s)
        return list(groups.values())
    raise ValueError(f"per must be 'shard' or 'curation', not {per!r}")


def train_pending(
    buf: Buffer,
    model,
    optimizer,
    scheduler,
    config: TrainConfig = TrainConfig(),
    *,
    at: RunPosition,
    pending: Pending = Pending(),
    tokenizer=None,
    extra_metrics: dict | None = None,
    context: TrainContext = TrainContext(),
    retention: tuple[int, int] | None = None,
) -> list[Checkpoint]:
    """Train every pending unit once, publishing one checkpoint per unit; return them.

    `at`: the run and where its model is (see `resume`). `pending`: which shards, and the unit.
    `extra_metrics` are added to each checkpoint's metrics (e.g. the loop's iteration). Each new
    version is one more than the highest published version of the buffer. `context.timings`, when
    given, gets the seconds spent in `optimiser` steps (reading the shards included) and checkpoint
    `publish`.
    `context.dist`: this rank; `model` / `optimizer` are then the wrapped ones (`parallel.wrap`).
    `retention`: (K, replay window): each publish prunes the run's versions `learner.retention` does
    not keep, in its own commit, and removes their files (None: every version keeps its files).
    """
    dist, timings = context.dist, context.timings
    todo = dist.broadcast(_pending_units(buf, model, at.version, pending) if dist.is_main else None)
    published: list[Checkpoint] = []
    version, step = at.version, at.step
    clock = Stopwatch(timings)
    for unit in todo:
        new_version = None
        if dist.is_main:
            latest = latest_checkpoint(buf)
            new_version = max(version, latest.version if latest else 0) + 1
        new_version = dist.broadcast(new_version)
        rows = train_on_curation(
            model, optimizer, scheduler, [os.path.join(buf.root, s.path) for s in unit], config,
            run_id=at.run_id, version=new_version, weights_version=version, start_step=step,
            context=replace(context, timings=None),  # its own laps (read, collate) are within `optimiser`
        )
        clock.lap("optimiser")
        step = rows[-1]["step"] if rows else step
        metrics = {
            "steps": len(rows),
            "step": step,
            "loss": sum(r["loss"] for r in rows) / len(rows) if rows else None,
            "tokens": sum(r["tokens"] for r in rows),
            "samples": sum(r["samples"] for r in rows),
            "positions": sum(r["positions"] for r in rows),
            **(extra_metrics or {}),
        }
        full = publishable(model, optimizer, dist)  # collective under FSDP2; None off rank 0
        outcome: Checkpoint | str | None = None
        if dist.is_main:
            try:
                outcome = save_checkpoint(buf, full[0], full[1], scheduler, tokenizer=tokenizer, publish=Publish(
                    new_version, at.run_id, [consumed_entry(shard_curation_id(s), s.path) for s in unit],
                    parent_version=version, step=step, metrics=metrics, training_rows=rows, lease=pending.lease,
                    retention=retention,
                ))
            except BaseException as exc:
                dist.broadcast(str(exc) or type(exc).__name__)
                raise
        outcome = dist.broadcast(outcome)
        if isinstance(outcome, str):
            raise CheckpointError(f"rank 0 did not publish v{new_version}: {outcome}")
        clock.lap("publish")
        published.append(outcome)
        version = new_version
    return published


def _curated(buf: Buffer, curation_ids: Sequence[str] | None) -> list[Shard]:
    """The live curated shards (of `curation_ids`, by their key when given: not every curated shard)."""
    if curation_ids is None:
        return buf.manifest.shards("curated")
    return buf.manifest.live_keyed("curated", list(curation_ids))


def _pending_units(buf: Buffer, model, version: int, pending: Pending) -> list[list[Shard]]:
    """The units to train (rank 0), every one checked against the model's vocabulary before the
    first is trained and published."""
    pool = pending.shards if pending.shards is not None else _curated(buf, pending.curation_ids)
    done = consumed_in_lineage(buf, version, [s.path for s in pool]) if get_checkpoint(buf, version) else set()
    ledger = [{"shard": s} for s in sorted(done)]  # of the pool's shards, those the lineage trained (by the ledger table)
    todo = _units(pending_shards(buf, ledger, pending.curation_ids, pool), pending.per)
    # what training reads, checked as a curation checks its inputs: the curated shards and every
    # rollouts shard they refer to (live, in place, size and sha256; each hashed once per process)
    verify_training_inputs(buf.root, buf.manifest, [s for unit in todo for s in unit])
    check_vocabulary([os.path.join(buf.root, s.path) for unit in todo for s in unit], vocabulary_size(model))
    return todo
