"""Learner input: training tokens per second from curated shards against the same batches in memory.

Rollouts for the tiny policy (`builtin:tiny`: character vocabulary, 64 positions) are generated
(`rollouts_table` with short responses, token ids folded into the tiny vocabulary), appended to a
buffer and curated once (`d3s`, progress 0.5). Then, in one child process with torch on one
thread and the same starting weights and optimiser state for every run:

- **from the store** — `learner.trainer.train_on_curation(model, ..., shards)`, the real trainer:
  it reads the curated Parquet shards (`learner.batches.read_curated`), pads micro-batches
  (`iter_rank_steps` → `collate`) and takes the optimiser steps;
- **pre-built in memory** — the same call with the batches built beforehand (the trainer's
  `read_curated`/`iter_rank_steps` swapped for the ready list), so the steps run the same code on the
  same tensors; this is what a trainer that keeps its rollouts in memory pays.

The two paths alternate `--repeat` times (the fastest of each is reported) so that load from other
processes hits both alike; the weights after both paths are checked identical (same batches, same
order). The overhead of the store is also timed directly: read + pad of every batch, alone (best of
`--repeat` after a warm-up read).

    python -m bench.learner_input --rows 4096 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from bench import common

MICRO_BATCH = 64  # the loop's and `rollstore train`'s default


def tiny_rollouts(n_rows: int, mean_tokens: int, seed: int = 0, step: int = 0):
    """Generated rollouts with token ids folded into the tiny policy's vocabulary (ids 4..23)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from rollstore.builtin.synthetic import rollouts_table

    t = rollouts_table(n_groups=max(1, n_rows // common.GROUP_SIZE), group_size=common.GROUP_SIZE,
                       mean_tokens=mean_tokens, seed=seed, step=step, n_prompts=256)
    for name in ("prompt_token_ids", "response_token_ids"):
        col = t.column(name).combine_chunks()
        vals = pc.add(pc.remainder(col.values, 20), 4).cast(pa.int32())
        i = t.column_names.index(name)
        t = t.set_column(i, t.schema.field(i), pa.ListArray.from_arrays(col.offsets, vals))
    return t


def prepare(root: str, n_rows: int, mean_tokens: int, recipe: str, progress: str) -> list[str]:
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.storage.buffer import Buffer

    with Buffer.init(root) as buf:
        buf.append_rollouts(tiny_rollouts(n_rows, mean_tokens), "bench-tiny")
        r = curate(buf, load_recipe(recipe), {"where": "true", "progress": progress})
    return [os.path.join(root, p) for p in r.output_files if p.startswith("curated/")]


def child(shards: list[str], repeat: int, prof: bool, model=None) -> dict:
    """Both paths in this process; `model` defaults to `builtin:tiny` (tests pass a smaller one)."""
    import torch

    torch.set_num_threads(1)
    import rollstore.learner.trainer as trainer
    from rollstore.learner.batches import iter_rank_steps, read_curated
    from rollstore.learner.config import TrainConfig

    if model is None:
        from rollstore.learner.policy_loading import load_policy
        from rollstore.builtin.resolve import resolve_model

        model, _tok = load_policy(resolve_model("builtin:tiny", quiet=True))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    real_read, real_iter = trainer.read_curated, trainer.iter_rank_steps

    # the store's overhead alone: read + pad every batch (best of `repeat`, after one warm-up)
    t_read = t_prepare = float("inf")
    for _ in range(max(1, repeat) + 1):
        t0 = time.perf_counter()
        rows = read_curated(shards)
        t1 = time.perf_counter()
        rank_steps = list(iter_rank_steps(rows, MICRO_BATCH))
        steps = [s.micro for s in rank_steps]
        t2 = time.perf_counter()
        t_read, t_prepare = min(t_read, t1 - t0), min(t_prepare, t2 - t0)
    n_rows = sum(len(b) for s in steps for b in s)
    tokens = int(sum(int(b.lengths.sum()) for s in steps for b in s))
    kept = int(sum(int(b.loss_mask.sum()) for s in steps for b in s))

    def run(path: str, only=None) -> tuple[float, dict]:
        model.load_state_dict(initial)
        opt, sched = trainer.make_optimizer(model, lr=1e-5)
        if path == "memory":
            trainer.read_curated = lambda *_a, **_k: None
            trainer.iter_rank_steps = lambda *_a, **_k: iter(only or rank_steps)
        try:
            t = time.perf_counter()
            trainer.train_on_curation(model, opt, sched, shards, TrainConfig(loss="grpo", micro_batch_size=MICRO_BATCH))
            return time.perf_counter() - t, {k: v.clone() for k, v in model.state_dict().items()}
        finally:
            trainer.read_curated, trainer.iter_rank_steps = real_read, real_iter

    run("memory", rank_steps[:2])  # warm-up (allocator, kernels)
    times = {"store": [], "memory": []}
    weights = {}
    for _ in range(max(1, repeat)):
        for path in ("store", "memory"):
            s, w = run(path)
            times[path].append(s)
            weights[path] = w
    same = all(torch.equal(weights["store"][k], weights["memory"][k]) for k in weights["store"])
    top = None
    if prof:
        _, top = common.profile(lambda: run("store"))
    return {"store": min(times["store"]), "memory": min(times["memory"]), "runs": times, "read_seconds": t_read,
            "prepare_seconds": t_prepare, "rows": n_rows, "tokens": tokens, "kept_tokens": kept,
            "steps": len(steps), "same_weights": same, "profile": top, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def measure(rows: int = 4096, mean_tokens: int = 32, repeat: int = 3, recipe: str = "d3s", progress: str = "0.5",
            profile: bool = False, workdir: str | None = None) -> dict:
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="rs-bench-learner-")
    try:
        shards = prepare(os.path.join(workdir, "buf"), rows, mean_tokens, recipe, progress)
        args = ["--child", "--repeat", repeat, "--shards", *shards]
        if profile:
            args.append("--profile")
        r = common.run_child("bench.learner_input", args)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    r.update({"candidates": rows, "mean_tokens": mean_tokens, "recipe": recipe, "progress": progress,
              "repeat": repeat, "n_shards": len(shards)})
    return r


def ratio(m: dict) -> float:
    """Tokens/s in memory over tokens/s from the store (≥ 1: the store's overhead factor)."""
    return m["store"] / m["memory"]


def overhead(m: dict) -> float:
    """Read + pad time as a fraction of the in-memory training time (robust to the machine's load)."""
    return m["prepare_seconds"] / m["memory"]


def tables(m: dict) -> str:
    t = m["tokens"]
    rows = [
        ["pre-built in memory (same batches, same steps)", m["memory"], t / m["memory"], m["rows"] / m["memory"], 1.0],
        ["**from curated shards** (`train_on_curation`: read + pad + steps)", m["store"], t / m["store"],
         m["rows"] / m["store"], ratio(m)],
        ["read + pad alone (the store's overhead, no steps)", m["prepare_seconds"], t / m["prepare_seconds"],
         m["rows"] / m["prepare_seconds"], None],
    ]
    out = common.md_table(["path", "seconds", "training tokens/s", "sequences/s", "time × in-memory"], rows)
    runs = "; ".join(f"{k}: " + ", ".join(f"{x:.2f}" for x in v) for k, v in m["runs"].items())
    return out + (f"\n\nThe store's overhead measured directly: read + pad of every batch = "
                  f"{100 * overhead(m):.1f} % of the in-memory training time (reading the Parquet shards "
                  f"{m['read_seconds']:.3f} s of it, the rest padding rows into tensors in `collate`). The end-to-end "
                  f"runs vary more than that from the machine's other load (seconds per run, {runs}), so the "
                  f"direct measurement is the number to carry over. Weights after both paths identical: "
                  f"{'yes' if m['same_weights'] else 'NO'}.")


def section(m: dict, command: str | None = None, level: int = 3) -> str:
    extra = [f"Policy `builtin:tiny` (2-layer Llama, hidden 128), torch {m['torch']} on {m['threads']} thread, CPU; "
             f"{m['candidates']:,} generated rollouts (mean {m['mean_tokens']} response tokens) curated by "
             f"`{m['recipe']}` at progress {m['progress']} into {m['n_shards']} curated shard(s): {m['rows']:,} "
             f"sequences, {m['tokens']:,} response tokens ({m['kept_tokens']:,} in the loss), {m['steps']} optimiser "
             f"steps of {MICRO_BATCH} (loss grpo, AdamW); paths alternate, fastest of {m['repeat']} each"]
    return common.header("Learner input: curated shards vs batches in memory", command, extra, level,
                         libs=("torch", "transformers", "pyarrow")) + "\n\n" + common.method(__doc__) + "\n\n" + tables(m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096, help="generated candidate rollouts")
    ap.add_argument("--mean-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--recipe", default="d3s")
    ap.add_argument("--progress", default="0.5")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--shards", nargs="*", default=[])
    a = ap.parse_args()
    if a.child:
        return common.child_result(child(a.shards, a.repeat, a.profile))
    m = measure(a.rows, a.mean_tokens, a.repeat, a.recipe, a.progress, a.profile)
    common.publish(section(m), record=not a.no_record)


if __name__ == "__main__":
    main()
