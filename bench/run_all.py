"""The benchmark suite (`make bench`): every table of issue 7, in one run, appended to RESULTS.md.

1. storage: bytes/token, write throughput and one-column read-back vs JSONL, torch.save, Parquet;
2. curation (`d3s`, `da3po`) vs the DuckDB scan floor and the in-memory numpy reference;
3. beyond memory: three buffer sizes under a tight DuckDB memory limit;
4. learner input: tokens/s from curated shards vs the same batches in memory (`builtin:tiny`);
5. growth: curation time at 1×, 2×, 4× the batch;

then a pyinstrument profile of the worst ratio (rollstore against a contender). The defaults
finish in about 10 minutes on two cores; `--scale N` multiplies every size (buffers, learner
rows), and each size has its own flag.

    python -m bench.run_all [--scale 1] [--tokens 10000000] [--memory-sizes 8e6 16e6 32e6]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from bench import common, curation, growth, learner_input, memory, storage


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def worst_ratios(results: dict) -> list[tuple[float, str, str]]:
    """(ratio, what, key) for every rollstore-vs-contender time ratio, worst first (> 1 = rollstore slower)."""
    out = []
    if "curation" in results:
        for recipe, (x_floor, x_mem) in curation.ratios(results["curation"]).items():
            out.append((x_floor, f"curation {recipe} vs the scan floor", f"curate:{recipe}"))
            out.append((x_mem, f"curation {recipe} vs the in-memory reference", f"curate:{recipe}"))
    if "storage" in results:
        s = results["storage"]
        for kind in s["seconds"]:
            if not kind.startswith("rollstore"):
                out.append((s["seconds"]["rollstore"] / s["seconds"][kind], f"storage write vs {kind}", "storage"))
                out.append((s["read"]["rollstore"] / s["read"][kind], f"storage read vs {kind}", "storage-read"))
    if "learner" in results:
        out.append((learner_input.ratio(results["learner"]), "learner input from shards vs in memory", "learner"))
    return sorted(out, reverse=True)


def profile_storage(shard_tokens: int) -> str:
    from rollstore.storage.buffer import Buffer

    table = common.step_table(0, shard_tokens)
    root = tempfile.mkdtemp(prefix="rs-bench-prof-")
    try:
        with Buffer.init(root) as buf:
            _, top = common.profile(lambda: buf.append_rollouts(table, "profile"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return top


def profiles(results: dict, roots: dict, args) -> str:
    ranked = worst_ratios(results)
    if not ranked:
        return ""
    lines = ["#### Profiles", "",
             "Every time ratio of rollstore against a contender, worst first (> 1: rollstore slower):", ""]
    lines.append(common.md_table(["ratio", "comparison"], [[f"{r:.2f}×", w] for r, w, _ in ranked]))
    done = set()
    # the worst ratio and every other one of at least 1.5× (one per kind), each profiled in a fresh run
    targets = [ranked[0]] + [x for x in ranked[1:] if x[0] >= 1.5]
    contrast = True
    for ratio, what, key in targets:
        if key in done or key == "storage-read":
            continue
        done.add(key)
        log(f"profiling {what}")
        if key.startswith("curate:"):
            recipe = key.split(":", 1)[1]
            r = curation.run_one("curate", roots["curation"], recipe, args.memory_limit, args.progress, profile=True)
            lines += ["", f"**{what} ({ratio:.2f}×)** — `rollstore curate {recipe}`, {r['seconds']:.2f} s in this "
                      "profiled run (time inside DuckDB is charged to the Python call that waits for it):", "",
                      "```", r["profile"], "```"]
            if contrast:
                contrast = False
                ref = curation.run_one("reference", roots["curation"], recipe, args.memory_limit, args.progress,
                                       profile=True)
                lines += ["", f"The in-memory reference for contrast ({ref['seconds']:.2f} s):", "", "```",
                          ref["profile"], "```"]
        elif key == "learner":
            m = learner_input.measure(args.learner_rows, repeat=1, profile=True)
            lines += ["", f"**{what} ({ratio:.2f}×)** — one `train_on_curation` call from the shards:", "",
                      "```", m["profile"], "```"]
        elif key.startswith("storage"):
            lines += ["", f"**{what} ({ratio:.2f}×)** — one `Buffer.append_rollouts` of a "
                      f"{args.shard_tokens:,}-token step:", "", "```", profile_storage(args.shard_tokens), "```"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every size by this")
    ap.add_argument("--tokens", type=int, default=10_000_000, help="storage and curation buffer (response tokens)")
    ap.add_argument("--shard-tokens", type=int, default=1_000_000)
    ap.add_argument("--recipes", nargs="+", default=["d3s", "da3po"])
    ap.add_argument("--memory-limit", default="1GB", help="DuckDB limit of the curation and growth runs")
    ap.add_argument("--progress", default="0")
    ap.add_argument("--repeat", type=int, default=2, help="fresh-process runs per curation measurement (best kept)")
    ap.add_argument("--memory-sizes", type=float, nargs=3, default=[8e6, 16e6, 32e6])
    ap.add_argument("--memory-tight", default="64MB")
    ap.add_argument("--memory-shard-tokens", type=int, default=500_000)
    ap.add_argument("--learner-rows", type=int, default=4096)
    ap.add_argument("--learner-repeat", type=int, default=3)
    ap.add_argument("--growth-base-steps", type=int, default=2)
    ap.add_argument("--only", nargs="+", default=["storage", "curation", "memory", "learner", "growth"],
                    choices=["storage", "curation", "memory", "learner", "growth"])
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--workdir", default=None, help="where the generated buffers go (removed afterwards)")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    a = ap.parse_args()
    s = a.scale
    tokens, shard_tokens = int(a.tokens * s), int(a.shard_tokens * max(1.0, s) if s >= 1 else a.shard_tokens * s)
    a.shard_tokens = shard_tokens
    mem_sizes = [int(x * s) for x in a.memory_sizes]
    mem_shard = int(a.memory_shard_tokens * min(1.0, s))
    learner_rows = max(64, int(a.learner_rows * min(1.0, s) if s < 1 else a.learner_rows * s))
    a.learner_rows = learner_rows

    started = time.perf_counter()
    load_start = common.load_avg()
    work = a.workdir or tempfile.mkdtemp(prefix="rs-bench-suite-")
    roots = {"curation": os.path.join(work, "curation")}
    results: dict = {}
    parts: list[str] = []
    cmd = common.command_line()
    try:
        if "storage" in a.only:
            log(f"storage: {tokens:,} tokens")
            results["storage"] = storage.measure(tokens, shard_tokens, os.path.join(work, "storage"))
            shutil.rmtree(os.path.join(work, "storage"), ignore_errors=True)
            parts.append(storage.section(results["storage"], cmd, level=4))
        if "curation" in a.only or "growth" in a.only:
            log(f"building the curation buffer: {tokens:,} tokens")
            common.build_buffer(roots["curation"], tokens, shard_tokens)
        if "curation" in a.only:
            log("curation vs floor and in-memory reference")
            results["curation"] = curation.measure(roots["curation"], a.recipes, a.memory_limit, a.progress, a.repeat,
                                                   os.path.join(work, "agreement"))
            parts.append(curation.section(results["curation"], cmd, level=4))
        if "memory" in a.only:
            log(f"beyond memory: {mem_sizes} tokens at {a.memory_tight}")
            results["memory"] = memory.measure(mem_sizes, a.recipes, a.memory_tight, mem_shard,
                                               os.path.join(work, "memory"))
            shutil.rmtree(os.path.join(work, "memory"), ignore_errors=True)
            parts.append(memory.section(results["memory"], cmd, level=4))
        if "learner" in a.only:
            log(f"learner input: {learner_rows} rollouts")
            results["learner"] = learner_input.measure(learner_rows, repeat=a.learner_repeat,
                                                       workdir=os.path.join(work, "learner"))
            parts.append(learner_input.section(results["learner"], cmd, level=4))
        if "growth" in a.only:
            base = a.growth_base_steps
            info = common.describe(roots["curation"])
            while base > 1 and 4 * base > info["shards"]:
                base //= 2
            log(f"growth: batches of {base}, {2 * base}, {4 * base} steps")
            results["growth"] = growth.measure(roots["curation"], a.recipes, base, a.memory_limit, a.progress)
            parts.append(growth.section(results["growth"], cmd, level=4))
        if not a.no_profile:
            parts.append(profiles(results, roots, a))
    finally:
        shutil.rmtree(work, ignore_errors=True) if not a.workdir else None
    wall = time.perf_counter() - started
    head = [f"## Suite run — {time.strftime('%Y-%m-%d %H:%M')}", "",
            f"Command: `{cmd}` (`make bench`)  ",
            f"Machine: {common.machine()}; load average at start {load_start} (1/5/15 min)  ",
            f"Versions: {common.versions('duckdb', 'pyarrow', 'numpy', 'torch', 'transformers')}; rollstore at "
            f"commit {common.commit()}  ",
            f"Wall time of the whole suite: {wall / 60:.1f} min", "",
            "Other processes share this machine, so absolute seconds are noisy; every comparison is a ratio of runs "
            "made side by side in this one invocation (each measurement in a fresh process, best of the repeats)."]
    text = "\n".join(head) + "\n\n" + "\n\n".join(p for p in parts if p)
    print(text)
    if not a.no_record:
        common.append_results(text)
    log(f"done in {wall / 60:.1f} min")


if __name__ == "__main__":
    main()
