"""Learner step throughput with 1 and 2 ranks (DDP, gloo, CPU) in one run, and the share of each
rank's step time spent reading curated shards and collating batches (the store's input cost).

    python -m bench.learner_ranks [--rows 256] [--steps-batch 16] [--no-record]

Invariants: both worlds train the same curated shards with the same global batch, each rank one
torch thread, ranks forked from this process (no re-import); only the ratio of this run is meant to
be compared (other work may share the machine). The aim: input cost <= 5 % of step time per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from bench.common import header, md_table, publish

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def _rank(root, shards, rank, world, rendezvous, batch, out_dir):
    import json

    import torch

    from rollstore.learner.config import TrainConfig, TrainContext
    from rollstore.learner.parallel import SINGLE, close, current, wrap
    from rollstore.learner.trainer import deterministic_cpu, make_optimizer, train_on_curation
    from learner_util import tiny_llama

    deterministic_cpu(0, threads=1)
    dist = SINGLE
    if world > 1:
        torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        dist = current("ddp")
    model = tiny_llama(0)
    opt, sched = make_optimizer(model, lr=1e-3)
    model, opt = wrap(model, opt, sched, dist)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    rows = train_on_curation(model, opt, sched, shards, TrainConfig(micro_batch_size=batch // 2, grad_accum=2),
                             context=TrainContext(dist=dist, timings=timings))
    wall = time.perf_counter() - start
    with open(os.path.join(out_dir, f"w{world}-r{rank}.json"), "w") as fh:
        json.dump({"wall": wall, "steps": len(rows), **timings}, fh)
    close(dist)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256, help="curated rows (4 shards)")
    ap.add_argument("--batch", type=int, default=16, help="global batch (rows per optimiser step)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    import json

    from learner_util import commit_curated, curated_rows
    from rollstore.storage.buffer import Buffer
    from test_checkpoint import fork, wait

    tmp = tempfile.mkdtemp(prefix="bench-distributed-")
    root = os.path.join(tmp, "buf")
    with Buffer.init(root) as b:
        rel = commit_curated(b, "c", [curated_rows("c", args.rows // 4, seed=s) for s in range(4)])
    shards = [os.path.join(root, p) for p in rel]
    table = []
    walls = {}
    for world in (1, 2):
        rdv = os.path.join(tmp, f"rendezvous-{world}")
        pids = [fork(_rank, root, shards, r, world, rdv, args.batch, tmp) for r in range(world)]
        assert all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in map(wait, pids))
        for r in range(world):
            with open(os.path.join(tmp, f"w{world}-r{r}.json")) as fh:
                t = json.load(fh)
            walls[world] = max(walls.get(world, 0.0), t["wall"])
            inp = t.get("read", 0.0) + t.get("collate", 0.0)
            table.append([f"{world} rank(s), rank {r}", t["steps"], t["steps"] / t["wall"], t.get("read", 0.0) * 1e3,
                          t.get("collate", 0.0) * 1e3, 100 * inp / t["wall"]])
    ratio = walls[1] / walls[2]
    text = "\n\n".join([
        header("Distributed learner: 1 vs 2 ranks (DDP, gloo, CPU)", libs=("torch", "pyarrow")),
        f"{args.rows} curated rows in 4 shards, tiny Llama (~0.1 M parameters), global batch {args.batch} "
        f"(micro {args.batch // 2} x accum 2), one torch thread per rank.",
        md_table(["world, rank", "steps", "steps/s", "read ms", "collate ms", "input % of step time"], table),
        f"2-rank / 1-rank step throughput: **{ratio:.2f}x**. The input cost (shard reading + collation) is "
        f"the share per rank of its wall time; aim <= 5 %.",
    ])
    publish(text, record=not args.no_record)


if __name__ == "__main__":
    main()
