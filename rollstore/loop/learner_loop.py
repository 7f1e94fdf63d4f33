"""`rollstore train`: train on curated shards exactly once each; with --follow, the learner process
of the two-process loop, leasing curated shards as curations appear.

Invariants: each unit (one curation's shards) is trained once and published as one checkpoint
together with its consumed ledger (and, with --follow, the ack of its leases) in one manifest commit.
Curated shards are verified against the manifest (size and sha256) before they are trained on.
Under torchrun (`--parallel ddp|fsdp`), rank 0 verifies, leases, prints and publishes; every rank
trains its block of each global step (learner/parallel.py). `--nproc N` starts the learner's named
entry (`rollstore.loop.learner_main`) under `python -m torch.distributed.run --standalone
--nproc-per-node N`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time

from typing import TYPE_CHECKING

from rich.console import Console

from rollstore.storage.buffer import Buffer
from rollstore.storage.errors import RollstoreError, unknown_curation
from rollstore.storage.store import cache_shards
from rollstore.storage.verify import verify_references, verify_shards, verify_training_inputs

if TYPE_CHECKING:
    from rollstore.learner.config import TrainConfig


def check_curations(buffer: str, curations: list[str]) -> None:
    """Refuse (one line) a `--curation` id that names no live curation of the buffer, before any
    model is loaded or shard leased: training "nothing pending" on a typo would look like success."""
    with Buffer.open(buffer) as buf:
        for cid in curations:
            if buf.manifest.live_key_count("curations", cid) == 0:
                raise unknown_curation(buf.root, cid, [s.key for s in buf.manifest.shards("curations")])


def run_train(buffer: str, model: str, config: TrainConfig, run_id: str, curations: list[str], out: Console, *,
              follow: bool = False, poll: float = 1.0, max_idle: float = 0.0, parallel: str = "none",
              keep_checkpoints: int | None = None) -> list:
    """Train the pending shards of `curations` (all, when empty) once each, one checkpoint per curation;
    with `follow`, lease curated shards as they appear until `max_idle` idle seconds (0: never), holding
    the version it trains from against pruning (`learner.retention.hold`). `keep_checkpoints`: K,
    the newest versions of the run that keep their files (None: all)."""
    import torch

    from rollstore.learner import parallel as ranks
    from rollstore.learner.config import TrainContext
    from rollstore.learner.consume import resume, train_pending
    from rollstore.learner.policy_loading import load_policy
    from rollstore.learner.trainer import make_optimizer
    from rollstore.builtin.resolve import check_refs, resolve_model

    check_refs(model)  # before ranks start or a model is built
    dist = ranks.init(parallel)
    if dist.active and dist.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    buf = Buffer.open(buffer)
    if not follow and not buf.manifest.shards("curated"):  # before any model is built or loaded
        buf.close()
        raise RollstoreError(f"nothing to train: {buf.root} has no curated rows (run `rollstore curate` first)")
    path = resolve_model(model) if dist.is_main else None  # rank 0 builds builtin:tiny once
    dist.barrier()
    model_obj, tokenizer = load_policy(dist.broadcast(path), device=str(dist.device))
    optimizer, scheduler = make_optimizer(model_obj, lr=config.lr, warmup_steps=config.warmup_steps)
    version, step = resume(buf, model_obj, optimizer, scheduler, run_id)
    model_obj, optimizer = ranks.wrap(model_obj, optimizer, scheduler, dist)
    train = functools.partial(train_pending, buf, model_obj, optimizer, scheduler, config, tokenizer=tokenizer,
                              context=TrainContext(dist=dist),
                              retention=None if keep_checkpoints is None else (keep_checkpoints, 0))

    def report(cks):
        if not dist.is_main:
            return
        for ck in cks:
            out.print(f"v{ck.version}: trained {len(ck.consumed)} shard(s) of "
                      f"{', '.join(sorted({c['curation_id'] for c in ck.consumed}))}; "
                      f"loss {ck.metrics.get('loss')}, tokens {ck.metrics.get('tokens')} -> {ck.path}", highlight=False)

    try:
        if not follow:
            return _train_once(buf, dist, train, report, out, run_id, version, step, curations)
        return _follow(buf, dist, train, report, run_id, version, step, curations, poll, max_idle)
    finally:
        buf.close()
        if sys.exc_info()[0] is None:  # on an error the launcher tears the ranks down
            ranks.close(dist)


def _train_once(buf, dist, train, report, out: Console, run_id: str, version: int, step: int,
                curations: list[str]) -> list:
    """Every pending unit of `curations` (all when empty), once, in this call."""
    from rollstore.learner.config import Pending, RunPosition

    if dist.is_main:
        wanted = [s for s in buf.manifest.shards("curated") if not curations or s.key in curations]
        cache_shards(buf.root, buf.manifest, wanted)  # a store's buffer: into this host's cache, verified
        verify_shards(buf.root, wanted)
    dist.barrier()
    cks = train(at=RunPosition(run_id, version, step), pending=Pending(curations or None, per="curation"))
    report(cks)
    if not cks and dist.is_main:
        out.print("nothing to train: every curated shard is already in this run's ledger")
    return cks


def _follow(buf, dist, train, report, run_id: str, version: int, step: int, curations: list[str],
            poll: float, max_idle: float) -> list:
    """Lease curated shards as they appear and train them, until `max_idle` idle seconds (0: never);
    rank 0 holds the version it trains from against pruning and releases it at the end."""
    from rollstore.learner import retention
    from rollstore.learner.config import Pending, RunPosition

    consumer, group = dist.broadcast(f"{run_id}-{os.getpid()}"), f"learner:{run_id}"
    idle_since = time.monotonic()
    held: tuple[int, float] | None = None  # (version, when) of this learner's hold on its version
    published = []
    try:
        while True:
            if dist.is_main and version and (held is None or held[0] != version
                                             or time.monotonic() - held[1] > retention.HOLD_TTL_S / 4):
                retention.hold(buf, f"learner {consumer}", version)
                held = (version, time.monotonic())
            shards = None
            if dist.is_main:  # rank 0 leases and verifies; every rank trains what it leased
                _lease_id, shards = buf.lease("curated", 64, consumer, group=group, ttl=3600.0)
                if curations:
                    shards = [s for s in shards if s.key in set(curations)]
                if shards:  # (and the rollouts shards they refer to; a store's buffer: cached first)
                    verify_training_inputs(buf.root, buf.manifest, shards)
                    verify_references(buf.root, buf.manifest, shards)
            shards = dist.broadcast(shards)
            stop = dist.broadcast(not shards and bool(max_idle) and time.monotonic() - idle_since > max_idle)
            if shards:
                cks = train(at=RunPosition(run_id, version, step),
                            pending=Pending(shards=shards, lease=(consumer, group), per="curation"))
                if cks:
                    version, step = cks[-1].version, cks[-1].step
                    published.extend(cks)
                    report(cks)
                idle_since = time.monotonic()
            elif stop:
                return published
            else:
                time.sleep(poll)
    finally:
        if dist.is_main:
            with contextlib.suppress(Exception):  # (an unreleased hold expires by itself)
                retention.release(buf, f"learner {consumer}")
