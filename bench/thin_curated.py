"""Thin curated shards, before and after: full curation ÷ its own dry run, and the curated folder's
bytes ÷ the rollouts folder's, with two code trees alternating on one host and one buffer.

The buffer (generated like `bench.curation`'s) is built once. Each round, for each tree in turn
(the order alternates between rounds): a fresh copy of the buffer, then in fresh child processes
run by that tree's own interpreter (`bench.curation --child floor`, `--child dry`, then `--child curate`), and the
bytes under `curated/` and `rollouts/` of the copy afterwards. The fastest round of each tree is
reported.

    python -m bench.thin_curated --before /path/to/main --tokens 2000000 --repeat 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import tempfile

from bench import common


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, files in os.walk(path) for f in files)


def child(tree: str, kind: str, root: str, recipe: str, progress: str, memory_limit: str) -> dict:
    python = os.path.join(tree, ".venv", "bin", "python")
    cmd = [python, "-m", "bench.curation", "--child", kind, "--root", root, "--recipe-one", recipe,
           "--memory-limit", memory_limit, "--progress", progress, "--where", "true", "--first-shards", "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tree,
                         env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if res.returncode != 0:
        raise RuntimeError(f"{tree}: {' '.join(cmd[1:])} failed:\n{res.stderr[-3000:]}")
    return json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1])


def one(tree: str, base: str, work: str, recipe: str, progress: str, memory_limit: str) -> dict:
    root = os.path.join(work, "copy")
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(base, root)
    try:
        floor = child(tree, "floor", root, recipe, progress, memory_limit)
        dry = child(tree, "dry", root, recipe, progress, memory_limit)
        full = child(tree, "curate", root, recipe, progress, memory_limit)
        return {"floor": floor["seconds"], "dry": dry["seconds"], "full": full["seconds"], "n_selected": full["n_selected"],
                "cpu": {k: x.get("cpu_seconds") for k, x in (("floor", floor), ("dry", dry), ("full", full))},
                "tokens_kept": full["tokens_kept"], "peak_rss_mib": full["peak_rss_mib"],
                "materialise": full["stages"].get("materialise + write + commit", 0.0),
                "curated_bytes": folder_bytes(os.path.join(root, "curated")),
                "rollouts_bytes": folder_bytes(os.path.join(root, "rollouts"))}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the previous code's tree (with its own .venv)")
    ap.add_argument("--after", default=common.ROOT, help="this code's tree (default: this one)")
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--shard-tokens", type=int, default=500_000)
    ap.add_argument("--recipe", default="d3s")
    ap.add_argument("--progress", default="0")
    ap.add_argument("--memory-limit", default="1GB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="rs-bench-thin-")
    try:
        base = os.path.join(work, "base")
        common.build_buffer(base, a.tokens, a.shard_tokens)
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for r in range(a.repeat):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for name in order:
                tree = a.before if name == "before" else a.after
                runs[name].append(one(tree, base, work, a.recipe, a.progress, a.memory_limit))
        tokens = common.describe(base)["tokens"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    lines = [f"### Thin curated shards: before and after — {when}", "",
             f"`python -m bench.thin_curated --before <main's tree> --tokens {a.tokens} --shard-tokens "
             f"{a.shard_tokens} --recipe {a.recipe} --progress {a.progress} --repeat {a.repeat}`", "",
             f"{tokens:,} response tokens, {a.recipe} (progress {a.progress}), {a.repeat} alternating rounds "
             "per tree on one host, fresh copy of one buffer per run; fastest round of each tree "
             "(every round's dry ÷ floor and full ÷ dry in brackets, each from the same round; the medians "
             "are of those per-round ratios, the figure to compare on a noisy host).", "",
             "| code | scan floor s | dry run s | dry ÷ floor | median dry ÷ floor | full s | full ÷ dry | "
             "median full ÷ dry | materialise + write + commit s | curated ÷ rollouts bytes | peak RSS MiB | selected | "
             "tokens kept |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        best = min(rs, key=lambda x: x["full"])
        every = ", ".join(f"{x['full'] / x['dry']:.2f}" for x in rs)
        floor, dry = min(x["floor"] for x in rs), min(x["dry"] for x in rs)
        every_floor = ", ".join(f"{x['dry'] / x['floor']:.2f}" for x in rs)
        median_floor = statistics.median(x["dry"] / x["floor"] for x in rs)
        median_full = statistics.median(x["full"] / x["dry"] for x in rs)
        lines.append(f"| {name} | {floor:.3f} | {dry:.3f} | {dry / floor:.2f} ({every_floor}) | {median_floor:.2f} | "
                     f"{best['full']:.3f} | {best['full'] / dry:.2f} ({every}) | {median_full:.2f} | {best['materialise']:.3f} | "
                     f"{best['curated_bytes'] / best['rollouts_bytes']:.2%} ({best['curated_bytes']:,} B) | "
                     f"{best['peak_rss_mib']:.0f} | {best['n_selected']} | {best['tokens_kept']} |")
    lines += ["", "CPU seconds of each child's run (user + system, every thread of the process: the work done, "
              "which a loaded host inflates far less than wall time); medians over the rounds, and the medians of the "
              "per-round ratios:", "",
              "| code | floor CPU s | dry CPU s | full CPU s | median dry ÷ floor (CPU) | median full ÷ dry (CPU) |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, rs in runs.items():
        cpu = [x["cpu"] for x in rs if None not in x["cpu"].values()]
        if not cpu:
            continue
        med = {k: statistics.median(c[k] for c in cpu) for k in ("floor", "dry", "full")}
        lines.append(f"| {name} | {med['floor']:.3f} | {med['dry']:.3f} | {med['full']:.3f} | "
                     f"{statistics.median(c['dry'] / c['floor'] for c in cpu):.2f} | "
                     f"{statistics.median(c['full'] / c['dry'] for c in cpu):.2f} |")
    lines.append("")
    common.publish("\n".join(lines) + "\n", record=not a.no_record)


if __name__ == "__main__":
    main()
