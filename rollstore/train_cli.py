"""`rollstore train`: train on curated shards exactly once each; with --follow, the learner process
of the two-process loop, leasing curated shards as curations appear.

Invariants: each unit (one curation's shards) is trained once and published as one checkpoint
together with its consumed ledger (and, with --follow, the ack of its leases) in one manifest commit.
Curated shards are verified against the manifest (size and sha256) before they are trained on.
"""

from __future__ import annotations

import os
import time

from rich.console import Console

from storage.buffer import Buffer
from storage.verify import verify_shards


def run_train(buffer, curations, model, loss, lr, epochs, micro_batch_size, grad_accum, run_id, follow, poll,
              max_idle, out: Console) -> list:
    from learner.consume import resume, train_pending
    from learner.models import load_policy
    from learner.trainer import make_optimizer
    from rollstore.models import resolve_model

    buf = Buffer.open(buffer)
    model_obj, tokenizer = load_policy(resolve_model(model))
    optimizer, scheduler = make_optimizer(model_obj, lr=lr)
    version, step = resume(buf, model_obj, optimizer, scheduler, run_id)
    kwargs = dict(loss=loss, epochs=epochs, micro_batch_size=micro_batch_size, grad_accum=grad_accum,
                  tokenizer=tokenizer, per="curation")
    published = []

    def report(cks):
        for ck in cks:
            out.print(f"v{ck.version}: trained {len(ck.consumed)} shard(s) of "
                      f"{', '.join(sorted({c['curation_id'] for c in ck.consumed}))}; "
                      f"loss {ck.metrics.get('loss')}, tokens {ck.metrics.get('tokens')} -> {ck.path}", highlight=False)

    try:
        if not follow:
            verify_shards(buf.root, [s for s in buf.manifest.shards("curated") if not curations or s.key in curations])
            cks = train_pending(buf, model_obj, optimizer, scheduler, run_id=run_id, from_version=version,
                                start_step=step, curation_ids=curations or None, **kwargs)
            report(cks)
            if not cks:
                out.print("nothing to train: every curated shard is already in this run's ledger")
            return cks
        consumer, group = f"{run_id}-{os.getpid()}", f"learner:{run_id}"
        idle_since = time.monotonic()
        while True:
            _lease_id, shards = buf.lease("curated", 64, consumer, group=group, ttl=3600.0)
            if curations:
                shards = [s for s in shards if s.key in set(curations)]
            if shards:
                verify_shards(buf.root, shards)
                cks = train_pending(buf, model_obj, optimizer, scheduler, run_id=run_id, from_version=version,
                                    start_step=step, shards=shards, lease=(consumer, group), **kwargs)
                if cks:
                    version, step = cks[-1].version, cks[-1].step
                    published.extend(cks)
                    report(cks)
                idle_since = time.monotonic()
            elif max_idle and time.monotonic() - idle_since > max_idle:
                break
            else:
                time.sleep(poll)
    finally:
        buf.close()
    return published
