"""Recipes compared on the built-in task: held-out pass@1 / pass@8 against learner tokens and iterations.

Every recipe runs the near-on-policy loop (`rollstore.loop.run_loop`) from the same warm-started
`builtin:tiny`, for several seeds, on the `train` split and on the `harder` split, and is judged on
the split's fixed held-out prompts.

Invariants (what makes the comparison fair):
- Same start: one warm-start checkpoint for every run.
- Same prompts: iteration i of seed s draws the same prompts for every recipe (the loop seeds the
  prompt draw with (seed, iteration) only).
- Same generation budget: one batch of P prompts × G samples per iteration for every recipe, no
  over-generation (`overgen=1`, `max_gen_batches=1`): filtering recipes train on fewer samples
  instead of sampling more.
- Same optimiser, learning rate, loss and evaluation for every recipe; nothing is tuned per recipe.
- Held-out pass@k is the unbiased estimator from n ≥ k samples per prompt at the sampling
  temperature; greedy accuracy is recorded beside it. Every evaluation is also stored in the run's
  buffer (`evaluations` table), every iteration's curation and training steps too.
- "Learner tokens" = kept (loss-mask) tokens the learner trained on, summed over iterations.
- Runs execute in a pool of `--jobs` spawned processes with one torch thread each; a run is a pure
  function of its configuration, so the pool size changes wall time, not results (up to the
  non-associativity of float sums across thread counts, which one thread each removes).

Writes `<out>/learning-<split>.json` (every run's curve), `<out>/learning-<split>.svg` (two
charts: pass@1 against learner tokens and against iterations, mean line and min–max band over
seeds) and appends a section to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

from bench.common import append_results, header, md_table  # noqa: E402

# (name in the tables, recipe, parameter overrides)
CONFIGS: list[tuple[str, str, dict[str, str]]] = [
    ("grpo", "grpo", {}),
    ("dapo", "dapo", {}),
    ("da3po", "da3po", {}),
    ("da3po-group", "da3po", {"amplify": "group"}),
    ("pods", "pods", {}),
    ("d3s", "d3s", {}),
    ("d3s-i", "d3s-i", {}),
    ("entropy-top", "entropy-top", {}),
]
SPLITS = {"train": ("builtin:arith", "heldout"), "harder": ("builtin:arith:harder", "heldout-harder")}


def run_one(job: dict) -> dict:
    """One loop run (in a worker process): its evaluation curve, consumption and wall time."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    from rollstore.loop import LoopConfig, run_loop
    from storage.buffer import Buffer

    root = os.path.join(job["out_root"], f"{job['split']}-{job['name']}-s{job['seed']}")
    if os.path.exists(root):
        import shutil

        shutil.rmtree(root)
    Buffer.init(root).close()
    cfg = LoopConfig(
        buffer=root, model=job["model"], prompts=SPLITS[job["split"]][0], recipe=job["recipe"],
        sets=dict(job["sets"]), iterations=job["iterations"], prompts_per_iter=job["prompts"],
        group_size=job["group_size"], lr=job["lr"], micro_batch_size=job["micro_batch"], grad_accum=job["grad_accum"],
        warmup_steps=job["warmup"], eval_every=job["eval_every"], eval_prompts=job["eval_prompts"],
        eval_split=SPLITS[job["split"]][1], eval_samples=job["eval_samples"], eval_ks=(1, job["eval_samples"]),
        overgen=1, max_gen_batches=1, seed=job["seed"], run_id=f"{job['name']}-s{job['seed']}",
    )
    t0 = time.perf_counter()
    summary = run_loop(cfg)
    wall = time.perf_counter() - t0
    tokens, samples, cum = 0, 0, {0: (0, 0)}
    for rep in summary["iterations"]:
        tokens += rep["tokens_kept"] * job["epochs"]
        samples += rep["samples_kept"] * job["epochs"]
        cum[rep["iteration"] + 1] = (tokens, samples)
    curve = []
    for m in summary["eval_metrics"]:
        t, s = cum[m["iteration"]]
        curve.append({**m, "learner_tokens": t, "learner_samples": s})
    return {**{k: job[k] for k in ("name", "recipe", "sets", "seed", "split", "lr")}, "curve": curve,
            "learner_tokens": tokens, "learner_samples": samples, "wall_seconds": wall, "buffer": root}


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "–"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


MIN_GAIN = 0.0025  # a quarter point: below it grpo's gain is noise and "tokens to target" is not defined


def tokens_to_gain(curve: list[dict], gain: float, metric: str = "pass@1") -> float | None:
    """Learner tokens at the first evaluation after the start whose metric gained ≥ `gain` (None: never)."""
    start = curve[0][metric]
    for point in curve[1:]:
        if point[metric] - start >= gain:
            return point["learner_tokens"]
    return None


def summarise(runs: list[dict], metric: str = "pass@1") -> tuple[list[list[str]], float | None]:
    """Rows of the results table and the gain target used for 'tokens to target' (None: undefined).

    The target is half of grpo's mean final gain over its own start; each run's tokens to target are
    the learner tokens at its first evaluation that gained that much over its own start.
    """
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["name"], []).append(r)
    base = by.get("grpo", [])
    grpo_gain = statistics.mean(r["curve"][-1][metric] - r["curve"][0][metric] for r in base) if base else 0.0
    target = 0.5 * grpo_gain if grpo_gain >= MIN_GAIN else None
    grpo_reached = [t for t in (tokens_to_gain(r["curve"], target, metric) for r in base) if t is not None] \
        if target is not None else []
    grpo_need = statistics.mean(grpo_reached) if grpo_reached else None
    rows = []
    for name, _, _ in CONFIGS:
        rs = by.get(name)
        if not rs:
            continue
        k = max(int(key.split("@")[1]) for key in rs[0]["curve"][-1] if key.startswith("pass@"))
        finals = [r["curve"][-1][metric] for r in rs]
        gains = [r["curve"][-1][metric] - r["curve"][0][metric] for r in rs]
        pk = [r["curve"][-1][f"pass@{k}"] for r in rs]
        greedy = [r["curve"][-1]["greedy_accuracy"] for r in rs]
        if target is None:
            rel = f"n/a (grpo gained {grpo_gain:+.3f})"
        else:
            reached = [t for t in (tokens_to_gain(r["curve"], target, metric) for r in rs) if t is not None]
            if not reached:
                rel = f"not reached (0/{len(rs)} seeds)"
            elif not grpo_need:
                rel = f"{statistics.mean(reached):,.0f} tokens ({len(reached)}/{len(rs)} seeds; grpo: never)"
            else:
                rel = f"{statistics.mean(reached) / grpo_need:.2f}× ({len(reached)}/{len(rs)} seeds)"
        rows.append([
            name, str(len(rs)), _mean_sd(finals), _mean_sd(gains), _mean_sd(pk), _mean_sd(greedy),
            f"{statistics.mean(r['learner_tokens'] for r in rs):,.0f}",
            f"{statistics.mean(r['learner_samples'] for r in rs):,.0f}",
            rel, f"{statistics.mean(r['wall_seconds'] for r in rs):.0f}",
        ])
    return rows, target


HEADER = ["recipe", "seeds", "final pass@1", "Δ pass@1 vs start", "final pass@k", "final greedy",
          "learner tokens", "learner samples", "tokens to target vs grpo", "wall s/run"]


def plot(runs: list[dict], split: str, path: str) -> None:
    from rollstore.report_svg import Series, line_chart

    by = {}
    for r in runs:
        by.setdefault(r["name"], []).append(r)
    charts = []
    for x_key, x_label in (("learner_tokens", "learner tokens consumed"), ("iteration", "iteration")):
        series = []
        for name, _, _ in CONFIGS:
            rs = by.get(name)
            if not rs:
                continue
            n = min(len(r["curve"]) for r in rs)
            pts, band = [], []
            for i in range(n):
                ys = [r["curve"][i]["pass@1"] for r in rs]
                x = statistics.mean(r["curve"][i][x_key] for r in rs)
                pts.append((x, statistics.mean(ys)))
                band.append((x, min(ys), max(ys)))
            series.append(Series(name, pts, band=band))
        charts.append(line_chart(series, title=f"held-out pass@1, {split} split (band: min–max over seeds)",
                                 x_label=x_label, y_label="pass@1", integer_x=x_key == "iteration"))
    # the report's chart classes, for a standalone file; the legend wraps: at most 4 recipes a chart line
    style = ("<style>svg{font-family:sans-serif}.ct{font-size:13px;font-weight:600}.tick{font-size:10.5px;fill:#555}"
             ".al{font-size:11px;fill:#555}.lg{font-size:11px}.grid{stroke:#e7eaee}.axis{stroke:#8a949e}</style>")
    body = "".join(f'<g transform="translate(0,{i * 270})">{c}</g>' for i, c in enumerate(charts))
    with open(path, "w") as fh:
        fh.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="540" height="{270 * len(charts)}">{style}{body}</svg>\n')


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 recipes, 1 seed, 2 iterations, tiny sizes")
    ap.add_argument("--splits", nargs="+", default=["train", "harder"], choices=sorted(SPLITS))
    ap.add_argument("--recipes", nargs="+", default=[c[0] for c in CONFIGS])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=64, help="prompts per iteration")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4, help="learning rate, the same for every recipe")
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--eval-prompts", type=int, default=500)
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--out", default=os.path.join(HERE, "learning"), help="where the JSON and SVG go")
    ap.add_argument("--root", default=None, help="where the run buffers go (default: a temporary directory)")
    ap.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    ap.add_argument("--from-json", action="store_true",
                    help="do not run: rebuild tables and plots from the JSON curves already in --out")
    args = ap.parse_args(argv)
    if args.quick:
        args.recipes = args.recipes if args.recipes != [c[0] for c in CONFIGS] else ["grpo", "d3s"]
        args.seeds, args.iterations, args.prompts, args.eval_every = 1, 2, 8, 1
        args.eval_prompts, args.eval_samples, args.group_size = 16, 2, 4
    unknown = set(args.recipes) - {c[0] for c in CONFIGS}
    if unknown:
        ap.error(f"unknown recipes {sorted(unknown)}; choose from {[c[0] for c in CONFIGS]}")

    from rollstore.loop import LoopConfig
    from rollstore.models import resolve_model

    defaults = LoopConfig(buffer="")
    model = resolve_model(args.model)
    os.makedirs(args.out, exist_ok=True)
    out_root = args.root or ("" if args.from_json else tempfile.mkdtemp(prefix="rollstore-learning-"))
    head = header("Learning: recipes compared on builtin:arith (bench/learning.py)",
                  libs=("torch", "transformers", "duckdb", "pyarrow"))  # load average taken at the start
    t0 = time.perf_counter()
    jobs = [
        {"name": name, "recipe": recipe, "sets": sets, "seed": seed, "split": split, "model": model,
         "iterations": args.iterations, "prompts": args.prompts, "group_size": args.group_size,
         "lr": args.lr if args.lr is not None else defaults.lr, "micro_batch": defaults.micro_batch_size,
         "grad_accum": defaults.grad_accum, "warmup": defaults.warmup_steps, "epochs": defaults.epochs,
         "eval_every": args.eval_every, "eval_prompts": args.eval_prompts, "eval_samples": args.eval_samples,
         "out_root": out_root}
        for split in args.splits for seed in range(args.seeds)
        for name, recipe, sets in CONFIGS if name in args.recipes
    ]
    runs = []
    if args.from_json:
        for split in args.splits:
            with open(os.path.join(args.out, f"learning-{split}.json")) as fh:
                runs += json.load(fh)
        lr = runs[0].get("lr", args.lr)  # curves written before runs recorded their lr
        wall = sum(r["wall_seconds"] for r in runs) / max(1, args.jobs)
    else:
        import multiprocessing as mp

        lr = jobs[0]["lr"]
        with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=mp.get_context("spawn")) as pool:
            for r in pool.map(run_one, jobs):
                last = r["curve"][-1]
                print(f"{r['split']:7s} {r['name']:12s} seed {r['seed']}: pass@1 {r['curve'][0]['pass@1']:.3f} → "
                      f"{last['pass@1']:.3f}, greedy {r['curve'][0]['greedy_accuracy']:.3f} → "
                      f"{last['greedy_accuracy']:.3f}, {r['learner_tokens']:,} learner tokens, "
                      f"{r['wall_seconds']:.0f} s", flush=True)
                runs.append(r)
        wall = time.perf_counter() - t0
    sections = []
    for split in args.splits:
        rs = [r for r in runs if r["split"] == split]
        if not args.from_json:
            with open(os.path.join(args.out, f"learning-{split}.json"), "w") as fh:
                json.dump(rs, fh, indent=1)
        svg = os.path.join(args.out, f"learning-{split}.svg")
        plot(rs, split, svg)
        rows, target = summarise(rs)
        table = md_table(HEADER, rows)
        shown = "none" if target is None else f"{target:.3f}"
        print(f"\n{split} split (target pass@1 for 'tokens to target': {shown})\n{table}")
        sections.append((split, table, target, os.path.relpath(svg, HERE)))
    if not args.no_record and not args.quick:
        lines = [
            f"Configuration: {args.seeds} seeds × {len(args.recipes)} recipes per split, {args.iterations} iterations of "
            f"{args.prompts} prompts × {args.group_size} samples (same prompts per iteration and seed for every recipe, "
            f"no over-generation), lr {lr:g}, micro-batch {defaults.micro_batch_size} × accumulation "
            f"{defaults.grad_accum}, loss {defaults.loss}; held-out: {args.eval_prompts} distinct prompts × "
            f"{args.eval_samples} samples at T={defaults.temperature} every {args.eval_every} iterations. "
            f"Start model: {model}. {len(runs)} runs in {wall / 60:.1f} min wall with {args.jobs} parallel jobs"
            + (" (sum of run times / jobs: tables rebuilt with --from-json)." if args.from_json else "."),
            "",
        ]
        for split, table, target, svg in sections:
            lines += [f"**{split} split** — 'tokens to target' = mean learner tokens until a run's held-out pass@1 "
                      f"first gains {'–' if target is None else f'{target:.4f}'} over its own start (half of grpo's "
                      f"mean final gain; undefined when grpo gains under {MIN_GAIN}), relative to grpo's; "
                      f"± is the standard deviation over seeds. Plot: [{svg}]({svg})", "", table, ""]
        append_results(head + "\n\n" + "\n".join(lines))
    print(f"\n{len(runs)} runs in {wall:.0f} s; buffers under {out_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
