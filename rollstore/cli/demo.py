"""`rollstore demo`: the loop on builtin:tiny + builtin:arith with the d3s recipe, then a summary.

Invariant: the demo only ever deletes a directory that an earlier demo made (it carries a
`.rollstore-demo` marker); any other existing path is refused.
"""

from __future__ import annotations

import os
import shutil
import time

from rich.console import Console

from rollstore.loop.driver import LoopConfig
from rollstore.loop.view import run_with_display
from rollstore.storage.buffer import Buffer
from rollstore.storage.errors import RollstoreError

MARKER = ".rollstore-demo"

QUERIES = [
    ("Why were candidates dropped, per iteration?",
     "SELECT c.progress, s.reason, count(*) AS n FROM selections s JOIN curations c USING (curation_id) "
     "GROUP BY ALL ORDER BY c.progress, n DESC"),
    ("How did the schedule anneal (samples and tokens kept)?",
     "SELECT round(progress, 2) AS t, n_selected, n_candidates, tokens_kept, tokens_candidate, "
     "round(adv_var_before, 3) AS var_before, round(adv_var_after, 3) AS var_after FROM curations ORDER BY progress"),
    ("Sampled accuracy and tokens per generation step",
     "SELECT step, policy_version, round(avg(correct::INT), 3) AS acc, count(*) AS n, sum(len(response_token_ids)) AS tokens FROM rollouts GROUP BY ALL ORDER BY step"),
]


def prepare(path: str) -> None:
    if os.path.exists(path):
        if not os.path.exists(os.path.join(path, MARKER)):
            raise RollstoreError(f"{path} exists and is not a demo buffer; choose another path")
        shutil.rmtree(path)
    Buffer.init(path).close()
    open(os.path.join(path, MARKER), "w").close()


def run_demo(path: str, iterations: int, recipe: str, console: Console, model: str = "builtin:tiny",
             seed: int = 0) -> dict:
    prepare(path)
    t0 = time.perf_counter()
    # The demo keeps the settings its numbers were measured with (README: μ 1, lr 5e-5 on builtin:arith),
    # whatever the recipe's TOML recommends for other tasks (d3s: μ 4, lr 2e-4 for long reasoning chains).
    cfg = LoopConfig(buffer=path, model=model, recipe=recipe, iterations=iterations, run_id="demo", seed=seed,
                     epochs=1, lr=5e-5)
    summary = run_with_display(cfg, console)
    wall = time.perf_counter() - t0
    loop_seconds = sum(r["seconds"] for r in summary["iterations"])
    evals = summary["evals"]
    before, after = evals[0][2], evals[-1][2]
    console.print()
    console.print("held-out greedy accuracy by iteration:", style="bold")
    for chunk in range(0, len(evals), 6):
        console.print("  " + "  ".join(f"{i:>3}: {a:6.1%}" for i, _v, a in evals[chunk:chunk + 6]), highlight=False)
    console.print(f"held-out greedy accuracy: {before:.1%} before -> {after:.1%} after {iterations} iterations of "
                  f"{recipe} ({after - before:+.1%} points; loop {loop_seconds:.0f} s, {wall:.0f} s wall)",
                  style="bold", highlight=False, markup=False)
    console.print(f"\nThe buffer is in {path}. Three queries worth trying:", highlight=False, markup=False)
    for title, sql in QUERIES:
        console.print(f"  # {title}", style="dim", markup=False)
        console.print(f'  rollstore sql {path} "{sql}"', highlight=False, markup=False)
    console.print(f"\nThe audit of the last curation:  rollstore audit {path}", highlight=False, markup=False)
    console.print(f"One rollout's kept tokens:      rollstore audit {path} --rollout ROLLOUT_ID", highlight=False, markup=False)
    console.print(f"Everything as one HTML page:    rollstore report {path} --out report.html", highlight=False, markup=False)
    summary["wall_seconds"] = wall
    summary["loop_seconds"] = loop_seconds
    summary["before"], summary["after"] = before, after
    return summary
