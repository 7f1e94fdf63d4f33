"""A loop-sized curation, committed, before and after: what one iteration of the demo loop pays to curate.

Builds a buffer with the demo loop itself (`run_loop`, d3s, 128 prompts × 8 on the built-in tiny policy,
`--iterations` steps), then, in fresh child processes of each tree (alternating, `--repeat` rounds), runs
`--curations` committed curations of one loop step each on a copy of that buffer, one session reused as the
loop reuses it (distinct `progress` values, so every one is a new curation id that writes its curated shard,
audit and record). Reports each tree's median wall and CPU milliseconds per curation (the first two of each
child left out: cold caches) and the before ÷ after ratios per round.

    python -m bench.loop_curation --before /path/to/previous/tree --repeat 3

Invariants: the child imports only `rollstore` (so it runs against whichever tree's interpreter runs it: the
tree's own `.venv`), and every child commits exactly `--curations` new curations (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(root: str, copy: str, curations: int, recipe: str) -> dict:
    from rollstore.curate.params import load_recipe, step_where
    from rollstore.curate.run import curate
    from rollstore.queries.session import Session
    from rollstore.storage.buffer import Buffer

    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(root, copy)
    walls, cpus = [], []
    try:
        with Buffer.open(copy) as buf:
            steps = sorted({int(s) for (s,) in _steps(buf)})
            with buf.snapshot() as snap:
                session = Session(snap, "1GB")
            try:
                for i in range(curations):
                    step = steps[len(steps) // 2 + i % (len(steps) - len(steps) // 2)]
                    t, c = time.perf_counter(), time.process_time()
                    out = curate(buf, load_recipe(recipe), {"where": step_where(_run_id(buf), step),
                                                           "progress": f"{0.001 + 0.01 * i:.3f}"}, session=session)
                    walls.append(time.perf_counter() - t)
                    cpus.append(time.process_time() - c)
                    if not out.committed or out.already_existed:
                        raise SystemExit(f"curation {i} did not commit a new curation")
            finally:
                session.close()
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    return {"wall_ms": statistics.median(walls[2:]) * 1000, "cpu_ms": statistics.median(cpus[2:]) * 1000,
            "curations": len(walls)}


def _steps(buf):
    from rollstore.queries.session import Session

    with buf.snapshot() as snap, Session(snap) as s:
        return s.execute("SELECT DISTINCT step FROM rollouts").fetchall()


def _run_id(buf) -> str:
    from rollstore.queries.session import Session

    with buf.snapshot() as snap, Session(snap) as s:
        return s.execute("SELECT any_value(run_id) FROM rollouts").fetchone()[0]


def build(root: str, iterations: int) -> None:
    from rollstore.builtin.resolve import resolve_model
    from rollstore.loop.driver import LoopConfig, run_loop
    from rollstore.storage.buffer import Buffer

    Buffer.init(root).close()
    run_loop(LoopConfig(buffer=root, model=resolve_model(LoopConfig(buffer="").model), iterations=iterations))


def run_child(tree: str, root: str, work: str, curations: int, recipe: str) -> dict:
    python = os.path.join(tree, ".venv", "bin", "python")
    out = subprocess.run([python, os.path.abspath(__file__), "--child", root, "--copy", os.path.join(work, "copy"),
                          "--curations", str(curations), "--recipe", recipe],
                         cwd=tree, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        raise SystemExit(f"{tree}: child failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="the previous code's tree (with its own .venv)")
    ap.add_argument("--after", default=ROOT, help="this code's tree (default: this one)")
    ap.add_argument("--iterations", type=int, default=20, help="loop steps in the buffer")
    ap.add_argument("--curations", type=int, default=14, help="committed curations per child")
    ap.add_argument("--recipe", default="d3s")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--copy", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.copy, a.curations, a.recipe)))
        return
    sys.path.insert(0, ROOT)
    from bench import common

    trees = {"before": a.before, "after": a.after} if a.before else {"this tree": a.after}
    work = tempfile.mkdtemp(prefix="rs-bench-loop-curation-")
    try:
        base = os.path.join(work, "base")
        build(base, a.iterations)
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(a.repeat):
            for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                runs[name].append(run_child(trees[name], base, work, a.curations, a.recipe))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [[name, f"{statistics.median(x['wall_ms'] for x in rs):.1f}", ", ".join(f"{x['wall_ms']:.0f}" for x in rs),
             f"{statistics.median(x['cpu_ms'] for x in rs):.1f}", ", ".join(f"{x['cpu_ms']:.0f}" for x in rs)]
            for name, rs in runs.items()]
    table = common.md_table(["code", "wall ms / curation (median of rounds)", "per round", "CPU ms / curation",
                             "per round"], rows)
    ratio = ""
    if a.before:
        per = [b["cpu_ms"] / f["cpu_ms"] for b, f in zip(runs["before"], runs["after"])]
        wall = [b["wall_ms"] / f["wall_ms"] for b, f in zip(runs["before"], runs["after"])]
        ratio = (f"\n\nbefore ÷ after per round: CPU {', '.join(f'{x:.2f}' for x in per)}; "
                 f"wall {', '.join(f'{x:.2f}' for x in wall)}.")
    text = (common.header("A loop-sized curation, committed, before and after (bench/loop_curation.py)",
                          None, [f"{a.iterations}-step demo-loop buffer, {a.recipe}, {a.curations} committed "
                                 f"curations of one step per child (session reused), {a.repeat} alternating rounds"],
                          libs=("duckdb", "pyarrow"))
            + "\n\n" + table + ratio + "\n")
    common.publish(text, record=not a.no_record)


if __name__ == "__main__":
    main()
