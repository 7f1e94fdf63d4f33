"""Where an iteration of the loop goes: per-phase seconds at the demo's settings.

Runs `rollstore.loop.run_loop` with `LoopConfig`'s defaults (the demo: d3s, 128 prompts × 8, one
torch thread) on the built-in tiny policy, sums the `phases` every `IterationReport` carries
(generation, reward, scoring, append, curation, optimiser, publish, evaluation, other) and prints
them per iteration and as shares of the iterations' wall time. The figure of merit is the share of
everything except generation and the optimiser steps ("overhead"): the store's cost of a loop.

Invariants: phases are wall seconds measured by `storage.timing.Stopwatch` laps that tile each
iteration from its first to its last instruction, so they add up to the iteration's time up to the
cost of the laps themselves; the first iteration (cold caches) is reported separately.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

from bench.common import append_results, header, md_table  # noqa: E402

CORE = ("generation", "optimiser")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=None, help="default: the demo's")
    ap.add_argument("--recipe", default=None, help="default: the demo's (d3s)")
    ap.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    args = ap.parse_args(argv)

    from rollstore.loop.driver import PHASES, LoopConfig, run_loop
    from rollstore.builtin.resolve import resolve_model
    from rollstore.storage.buffer import Buffer

    defaults = LoopConfig(buffer="")
    iterations = args.iterations or defaults.iterations
    recipe = args.recipe or defaults.recipe
    model = resolve_model(defaults.model)
    head = header("Loop profile: one iteration at the demo's settings (bench/loop_profile.py)",
                  libs=("torch", "transformers", "duckdb", "pyarrow"))
    with tempfile.TemporaryDirectory(prefix="rollstore-loop-profile-") as tmp:
        root = os.path.join(tmp, "buf")
        Buffer.init(root).close()
        reports = []
        t0 = time.perf_counter()
        summary = run_loop(LoopConfig(buffer=root, model=model, iterations=iterations, recipe=recipe),
                           on_iteration=reports.append)
        wall = time.perf_counter() - t0
    first, rest = reports[0], reports[1:] or reports
    total = sum(r.seconds for r in rest)
    per = {p: sum(r.phases.get(p, 0.0) for r in rest) for p in PHASES}
    unaccounted = total - sum(per.values())
    rows = [[p, f"{per[p] / len(rest) * 1000:.1f}", f"{per[p] / total:.1%}", f"{first.phases.get(p, 0.0) * 1000:.1f}"]
            for p in PHASES]
    rows.append(["(between laps)", f"{unaccounted / len(rest) * 1000:.1f}", f"{unaccounted / total:.1%}", ""])
    rows.append(["iteration", f"{total / len(rest) * 1000:.1f}", "100 %", f"{first.seconds * 1000:.1f}"])
    overhead = 1 - sum(per[p] for p in CORE) / total
    curation = per["curation"] / total
    table = md_table(["phase", "ms per iteration", "share", "first iteration, ms"], rows)
    evals = summary["evals"]
    text = (f"{head}\n\n{iterations} iterations of `{recipe}` at `LoopConfig`'s defaults (the demo: "
            f"{defaults.prompts_per_iter} prompts × {defaults.generation.group_size}, optimiser steps of "
            f"{defaults.train.micro_batch_size} kept samples, held-out greedy evaluation of {defaults.eval_prompts} prompts "
            f"every {defaults.eval_every} iterations, {defaults.threads} torch thread), {model}; means over "
            f"iterations 2–{iterations}. Held-out greedy accuracy {evals[0][2]:.1%} → {evals[-1][2]:.1%}; "
            f"{wall:.1f} s for the run.\n\n{table}\n\n**Everything except generation and the optimiser steps: "
            f"{overhead:.1%} of iteration wall time.** Curation: {curation:.1%} (the off-policy correction "
            f"runs no forward of its own: π_prox is the training forward's log-probs).\n")
    print(text)
    if not args.no_record:
        append_results(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
