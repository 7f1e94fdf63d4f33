"""Curation speed and memory against the scan floor, side by side in one run.

For a generated buffer of N tokens, each measurement runs in a fresh child process (so peak RSS is
its own): (a) the floor — one DuckDB scan over the same columns computing the same |A|·H token
scores (advantages from a group-by) without selecting anything; (b) `rollstore curate` with the
given recipe over the whole buffer (`where = true`). Prints a table and appends it to
bench/RESULTS.md with the machine, versions and command.

    python -m bench.curation --tokens 10_000_000 --recipes d3s da3po --memory-limit 1GB
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

FLOOR_SQL = """
WITH adv AS (
    SELECT rollout_id, entropies,
           (reward - avg(reward) OVER g) / (stddev_samp(reward) OVER g + 1e-6) AS a
    FROM rollouts WINDOW g AS (PARTITION BY group_id)
)
SELECT count(*), sum(abs(a) * h) FROM (SELECT a, unnest(entropies) AS h FROM adv)
"""


def build(root: str, tokens: int, seed: int = 0, mean_tokens: int = 256, group_size: int = 8) -> dict:
    from rollstore.synthetic import rollouts_table
    from storage.buffer import Buffer

    buf = Buffer.init(root)
    per_step_groups = 500
    total, step = 0, 0
    while total < tokens:
        table = rollouts_table(n_groups=per_step_groups, group_size=group_size, mean_tokens=mean_tokens,
                               seed=seed, step=step, policy_version=step // 4, n_prompts=2000)
        shard = buf.append_rollouts(table, f"bench-step-{step}")
        total += shard.tokens
        step += 1
    buf.close()
    return describe(root)


def describe(root: str) -> dict:
    from storage.buffer import Buffer

    with Buffer.open(root) as buf:
        shards = buf.snapshot().shards("rollouts")
    return {"tokens": sum(s.tokens for s in shards), "rows": sum(s.rows for s in shards), "shards": len(shards),
            "bytes": sum(s.bytes for s in shards)}


def child(kind: str, root: str, recipe: str, memory_limit: str, progress: str) -> dict:
    t0 = time.perf_counter()
    if kind == "floor":
        from queries.session import Session
        from storage.buffer import Buffer

        with Buffer.open(root) as buf, buf.snapshot() as snap, Session(snap, memory_limit) as s:
            s.one(FLOOR_SQL)
        out = {}
    else:
        from curate.params import load_recipe
        from curate.run import curate
        from storage.buffer import Buffer

        with Buffer.open(root) as buf:
            r = curate(buf, load_recipe(recipe), {"where": "true", "progress": progress}, memory_limit=memory_limit)
        out = {"n_selected": r.record["n_selected"], "tokens_kept": r.record["tokens_kept"]}
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def run_child(kind: str, root: str, recipe: str, memory_limit: str, progress: str) -> dict:
    cmd = [sys.executable, "-m", "bench.curation", "--child", kind, "--root", root, "--recipe-one", recipe,
           "--memory-limit", memory_limit, "--progress", progress]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"child {kind} failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def versions() -> str:
    import duckdb
    import pyarrow

    return f"python {platform.python_version()}, duckdb {duckdb.__version__}, pyarrow {pyarrow.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--recipes", nargs="+", default=["d3s", "da3po"])
    ap.add_argument("--memory-limit", default="1GB")
    ap.add_argument("--progress", default="0")
    ap.add_argument("--root", default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--recipe-one", default="d3s")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.root, a.recipe_one, a.memory_limit, a.progress)))
        return
    root = a.root or tempfile.mkdtemp(prefix="rs-bench-")
    info = build(root, a.tokens) if not os.path.exists(os.path.join(root, "manifest.sqlite")) else describe(root)
    floor = run_child("floor", root, "", a.memory_limit, a.progress)
    rows = [("scan floor (DuckDB, same columns, \\|A\\|·H)", floor, 1.0)]
    for recipe in a.recipes:
        r = run_child("curate", root, recipe, a.memory_limit, a.progress)
        rows.append((f"rollstore curate {recipe} (progress {a.progress})", r, r["seconds"] / floor["seconds"]))
    tokens = info.get("tokens", a.tokens)
    lines = [
        f"### Curation vs scan floor — {time.strftime('%Y-%m-%d')}",
        "",
        f"Command: `python -m bench.curation --tokens {a.tokens} --recipes {' '.join(a.recipes)} "
        f"--memory-limit {a.memory_limit} --progress {a.progress}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; {versions()}  ",
        f"Buffer: {tokens:,} tokens, {info.get('rows', '?')} rollouts in {info.get('shards', '?')} shards, "
        f"{info.get('bytes', 0) / 2**20:.1f} MiB on disk; DuckDB memory_limit {a.memory_limit}",
        "",
        "| run | seconds | × floor | Mtokens/s | peak RSS (MiB) | selected | tokens kept |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r, ratio in rows:
        lines.append(f"| {name} | {r['seconds']:.2f} | {ratio:.2f} | {tokens / r['seconds'] / 1e6:.2f} | "
                     f"{r['peak_rss_mb']:.0f} | {r.get('n_selected', '')} | {r.get('tokens_kept', '')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_record:
        with open(os.path.join(HERE, "RESULTS.md"), "a", encoding="utf-8") as fh:
            fh.write("\n" + text)


if __name__ == "__main__":
    main()
