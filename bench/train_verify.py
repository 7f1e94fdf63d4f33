"""Training's input verification: `rollstore train` with and without hashing the rollouts shards
that thin curated shards refer to (issue 35; docs/integrity.md §What each command verifies).

Rollouts for the tiny policy (`builtin:tiny`; `bench.learner_input.tiny_rollouts`) are appended
as `--shards` rollouts shards of about `--tokens` response tokens in all and curated once over all
of them (`--recipe`, `where=true`), so the curation refers to every rollouts shard. Then, in one
child process with torch on one thread, `learner.consume.train_pending` — what `rollstore train`
runs after loading the model — trains the curation from the same starting weights, twice per
round, alternating:

- **with** — as shipped: `storage.verify.verify_training_inputs` hashes the curated shards and
  every referenced rollouts shard before the first unit (the per-process cache cleared first, as
  in a fresh `rollstore train` process);
- **without** — the check as it was before: the curated shards' sha256 only.

Each run trains under a new run id (nothing of the other runs is in its ledger) and publishes one
checkpoint, as `rollstore train` does. The hash of the referenced shards is also timed alone
(cold per-process cache, warm page cache). Inside one process the cache makes a second curation
over the same rollouts shards pay a `stat` per shard, not a hash.

    python -m bench.train_verify --tokens 10000000 --repeat 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from bench import common
from bench.learner_input import MICRO_BATCH, tiny_rollouts


def prepare(root: str, tokens: int, shards: int, mean_tokens: int, recipe: str, progress: str) -> dict:
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.storage.buffer import Buffer

    rows = max(common.GROUP_SIZE, tokens // mean_tokens // shards)
    with Buffer.init(root) as buf:
        for k in range(shards):
            buf.append_rollouts(tiny_rollouts(rows, mean_tokens, seed=k, step=k), f"bench-tiny-{k}")
        r = curate(buf, load_recipe(recipe), {"where": "true", "progress": progress})
        rollouts = buf.manifest.shards("rollouts")
    return {"curation_id": r.curation_id, "candidate_tokens": int(r.record["tokens_candidate"]),
            "selected_rows": int(r.record["n_selected"]), "kept_tokens": int(r.record["tokens_kept"]),
            "rollouts_shards": len(rollouts), "rollouts_bytes": sum(s.bytes for s in rollouts)}


def child(root: str, repeat: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from rollstore.learner import consume
    from rollstore.learner.config import Pending, RunPosition, TrainConfig
    from rollstore.learner.policy_loading import load_policy
    from rollstore.learner.trainer import make_optimizer
    from rollstore.builtin.resolve import resolve_model
    from rollstore.storage import verify
    from rollstore.storage.buffer import Buffer

    model, tok = load_policy(resolve_model("builtin:tiny", quiet=True))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    real = consume.verify_training_inputs

    def curated_only(root_, _manifest, shards):  # the check before issue 35: the curated shards' sha256
        verify.verify_shards(root_, shards)

    buf = Buffer.open(root)
    curated = buf.manifest.shards("curated")
    hash_times = []
    for _ in range(max(1, repeat)):
        verify._verified.clear()
        verify.verify_shards(buf.root, curated)  # the curated shards alone, as in both modes
        t = time.perf_counter()
        real(buf.root, buf.manifest, curated)
        hash_times.append(time.perf_counter() - t)

    def run(mode: str, n: int) -> float:
        model.load_state_dict(initial)
        opt, sched = make_optimizer(model, lr=1e-5)
        verify._verified.clear()  # a fresh `rollstore train` process
        consume.verify_training_inputs = real if mode == "with" else curated_only
        try:
            t = time.perf_counter()
            cks = consume.train_pending(buf, model, opt, sched, TrainConfig(loss="grpo", micro_batch_size=MICRO_BATCH),
                                        at=RunPosition(f"bench-{mode}-{n}", 0, 0), pending=Pending(per="curation"),
                                        tokenizer=tok)
            seconds = time.perf_counter() - t
        finally:
            consume.verify_training_inputs = real
        assert len(cks) == 1
        return seconds

    times: dict[str, list[float]] = {"with": [], "without": []}
    for n in range(max(1, repeat)):
        for mode in (("without", "with") if n % 2 else ("with", "without")):
            times[mode].append(run(mode, n))
    buf.close()
    return {"runs": times, "hash_seconds": hash_times, "torch": torch.__version__, "threads": torch.get_num_threads()}


def measure(tokens: int, shards: int, mean_tokens: int, repeat: int, recipe: str, progress: str,
            workdir: str | None = None) -> dict:
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="rs-bench-train-verify-")
    try:
        root = os.path.join(workdir, "buf")
        info = prepare(root, tokens, shards, mean_tokens, recipe, progress)
        r = common.run_child("bench.train_verify", ["--child", "--repeat", repeat, "--root", root])
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    r.update(info)
    r.update({"recipe": recipe, "progress": progress, "repeat": repeat, "mean_tokens": mean_tokens})
    return r


def section(m: dict, command: str | None = None, level: int = 3) -> str:
    w, wo = m["runs"]["with"], m["runs"]["without"]
    rows = [[f"round {i + 1}", a, b, a / b] for i, (a, b) in enumerate(zip(w, wo))]
    rows.append(["**median**", statistics.median(w), statistics.median(wo),
                 statistics.median(a / b for a, b in zip(w, wo))])
    table = common.md_table(["run", "with the referenced shards hashed s", "curated shards only s", "with ÷ without"],
                            rows, digits=3)
    h = min(m["hash_seconds"])
    extra = [f"Policy `builtin:tiny`, torch {m['torch']} on {m['threads']} thread, CPU; {m['rollouts_shards']} rollouts "
             f"shards, {m['rollouts_bytes'] / 1e6:.1f} MB, {m['candidate_tokens']:,} candidate response tokens, curated "
             f"by `{m['recipe']}` (progress {m['progress']}): {m['selected_rows']:,} rows, {m['kept_tokens']:,} "
             f"tokens in the loss; micro-batch {MICRO_BATCH}, one checkpoint published per run; modes alternate"]
    note = (f"\n\nHashing the referenced rollouts shards alone (cold per-process cache, warm page cache): "
            f"{h:.3f} s for {m['rollouts_bytes'] / 1e6:.1f} MB ({m['rollouts_bytes'] / 1e6 / h:.0f} MB/s), "
            f"{100 * h / statistics.median(wo):.2f} % of the median run without it. Runs (s): with "
            + ", ".join(f"{x:.2f}" for x in w) + "; without " + ", ".join(f"{x:.2f}" for x in wo) + ".")
    return (common.header("Training verifies the rollouts shards it refers to: rollstore train with and without",
                          command, extra, level, libs=("torch", "pyarrow", "duckdb"))
            + "\n\n" + common.method(__doc__) + "\n\n" + table + note)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000_000, help="candidate response tokens in all")
    ap.add_argument("--shards", type=int, default=10, help="rollouts shards (steps)")
    ap.add_argument("--mean-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--recipe", default="d3s")
    ap.add_argument("--progress", default="0")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--root", default="")
    a = ap.parse_args()
    if a.child:
        return common.child_result(child(a.root, a.repeat))
    m = measure(a.tokens, a.shards, a.mean_tokens, a.repeat, a.recipe, a.progress)
    common.publish(section(m), record=not a.no_record)


if __name__ == "__main__":
    main()
