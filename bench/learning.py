"""Recipes compared on the built-in task: held-out pass@1 / pass@8 against rollouts generated.

Every recipe runs the near-on-policy loop (`rollstore.loop.run_loop`) from the same warm-started
`builtin:tiny`, for several paired seeds, and is judged on the split's fixed held-out prompts.

Invariants (what makes the comparison fair):
- Same start: one warm-start checkpoint for every run.
- Paired seeds: iteration i of seed s trains on the same first batch of prompts for every recipe
  (a pool of prompts in epochs, `LoopConfig.pool_size`, seeded by s only), and evaluations use the
  same sample draws (common random numbers).
- Generation is the cost axis: every run reports the rollouts it generated, dropped ones included.
  Filtering recipes (dynamic sampling) over-generate as their papers do: after the first batch
  they draw more batches of the same size until P groups survive or `--max-gen-batches` is hit.
- Same optimiser, learning rate, loss, batch and evaluation for every recipe; nothing is tuned per
  recipe (`--lr` is the loop's default, chosen on grpo and d3s in the demo's setting).
- Held-out pass@k is the unbiased estimator from n ≥ k samples per prompt at the sampling
  temperature; greedy accuracy is recorded beside it. Every evaluation is also stored in the run's
  buffer (`evaluations` table), every iteration's curation and training steps too.
- "Rollouts to grpo's final": per seed, the rollouts generated until a run's pass@1 first reaches
  that seed's grpo final pass@1 (linear between evaluations), divided by grpo's own; summarised as
  the geometric mean over the seeds that reach it, with a 95 % t-interval on the log ratios.
- Runs execute in a pool of `--jobs` spawned processes with one torch thread each; a run is a pure
  function of its configuration, so the pool size changes wall time, not results.

Writes `<out>/learning-<split>.json` (every run's curve), `<out>/learning-<split>.svg` (pass@1
against rollouts generated and against learner tokens: mean line and min–max band over seeds) and
appends a section to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

from bench import tuned  # noqa: E402
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
    ("replay-window", "replay-window", {}),
    ("replay-groups", "replay-groups", {}),
    ("replay-rollouts", "replay-rollouts", {}),
    ("replay-d3s", "replay-d3s", {}),
    # more reuse: window 3, each rollout at most 3 times, up to 2 replayed rows per fresh row
    ("replay-rollouts-x3", "replay-rollouts-x3", {}),  # = replay-rollouts with window 3, 3 uses, 1024 rows
    ("replay-window-x3", "replay-window", {"replay_window": "2", "replay_max_uses": "3"}),
    ("greso", "greso", {}),  # grpo + pre-rollout prompt selection from the run's history
]
# split → (training prompts, held-out split, start model)
SPLITS = {
    "train": ("builtin:arith", "heldout", "builtin:tiny"),
    "harder": ("builtin:arith:harder", "heldout-harder", "builtin:tiny"),
    "carries": ("builtin:carries", "heldout", "builtin:tiny-carries"),  # three digits, levels 0–3 carries
    "chains": ("builtin:chains", "heldout", "builtin:tiny-chains"),  # the working written out, 29–33 tokens
}


def run_one(job: dict) -> dict:
    """One loop run (in a worker process): its evaluation curve, consumption and wall time."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    from rollstore.builtin.resolve import task_max_new_tokens
    from rollstore.learner.config import TrainConfig
    from rollstore.loop.generate import GenerationConfig
    from rollstore.loop import LoopConfig, run_loop
    from rollstore.storage.buffer import Buffer

    root = os.path.join(job["out_root"], f"{job['split']}-{job['name']}-s{job['seed']}")
    if job.get("reuse"):
        done = from_buffer(root, job)
        if done is not None:
            return done
    if os.path.exists(root):
        import shutil

        shutil.rmtree(root)
    Buffer.init(root).close()
    cfg = LoopConfig(
        buffer=root, model=job["model"], prompts=SPLITS[job["split"]][0], recipe=job["recipe"],
        sets=dict(job["sets"]), iterations=job["iterations"], prompts_per_iter=job["prompts"],
        generation=GenerationConfig(group_size=job["group_size"], max_new_tokens=task_max_new_tokens(SPLITS[job["split"]][0])),
        train=TrainConfig(lr=job["lr"], micro_batch_size=job["micro_batch"], grad_accum=job["grad_accum"],
                          warmup_steps=job["warmup"]),
        eval_every=job["eval_every"], eval_prompts=job["eval_prompts"],
        eval_split=SPLITS[job["split"]][1], eval_samples=job["eval_samples"], eval_ks=(1, job["eval_samples"]),
        overgen=1, max_gen_batches=job["max_gen_batches"], pool_size=job["pool_size"], seed=job["seed"],
        run_id=f"{job['name']}-s{job['seed']}", epochs=job["epochs"], lr=job["lr"],
    )
    t0 = time.perf_counter()
    summary = run_loop(cfg)
    wall = time.perf_counter() - t0
    costs = _learner_costs(root, summary)
    tokens, samples, rollouts, seconds, passes, generated = 0, 0, 0, 0.0, 0, 0
    cum = {0: (0, 0, 0, 0.0, 0, 0)}
    for rep in summary["iterations"]:
        trained, gen_tokens = costs[rep["iteration"]]
        tokens += rep["tokens_kept"] * summary["epochs"]
        samples += rep["samples_kept"] * summary["epochs"]
        passes += trained * summary["epochs"]
        rollouts += rep["rollouts"]
        generated += gen_tokens
        seconds += rep["seconds"]
        cum[rep["iteration"] + 1] = (tokens, samples, rollouts, seconds, passes, generated)
    curve = []
    for m in summary["eval_metrics"]:
        t, s, g, w, tp, gt = cum[m["iteration"]]
        curve.append({**m, "learner_tokens": t, "learner_samples": s, "rollouts": g, "seconds": w,
                      "token_passes": tp, "generated_tokens": gt})
    phases: dict[str, float] = {}
    for rep in summary["iterations"]:
        for k, v in rep["phases"].items():
            phases[k] = phases.get(k, 0.0) + v
    return {**{k: job[k] for k in ("name", "recipe", "sets", "seed", "split", "lr", "epochs")}, "curve": curve,
            "learner_tokens": tokens, "learner_samples": samples, "rollouts": rollouts, "wall_seconds": wall,
            "token_passes": passes, "generated_tokens": generated, "phases": phases,
            "loop_seconds": sum(r["seconds"] for r in summary["iterations"]),
            "skips": summary["skips"], "skip_outcomes": _skip_outcomes(root), "buffer": root}


def from_buffer(root: str, job: dict) -> dict | None:
    """A finished run rebuilt from its buffer alone (None if the buffer is missing or the run did not
    reach its last evaluation): the curve from `evaluations`, rollouts and tokens per step from
    `rollouts`, costs from `selections`, the skips from `prompt_selections`. The run's own timings are
    not stored: wall and loop seconds are the span of its rows' timestamps, and phases are absent."""
    import re

    from rollstore.queries.session import Session
    from rollstore.storage.buffer import Buffer

    if not os.path.exists(os.path.join(root, "manifest.sqlite")):
        return None
    with Buffer.open(root) as buf, buf.snapshot() as snap, Session(snap) as s:
        evals = s.execute("SELECT iteration, metric, value, epoch(created_at) FROM evaluations ORDER BY iteration").fetchall()
        if not evals or max(e[0] for e in evals) < job["iterations"]:
            return None
        curs = s.execute("SELECT c.params, s.n, s.trained, c.tokens_kept FROM curations c JOIN (SELECT "
                         "curation_id, count(*) FILTER (WHERE selected) AS n, sum(tokens_total) FILTER (WHERE selected) "
                         "AS trained FROM selections GROUP BY curation_id) s USING (curation_id)").fetchall()
        gen = {int(st): (int(n), int(t or 0)) for st, n, t in s.execute(
            "SELECT step, count(*), sum(len(response_token_ids)) FROM rollouts GROUP BY step").fetchall()}
        start = s.one("SELECT epoch(min(created_at)) FROM rollouts")[0]
        skips = s.execute("SELECT step, count(*) FILTER (WHERE decision = 'skip'), count(*) FROM prompt_selections "
                          "GROUP BY step ORDER BY step").fetchall()
    per_step = {}
    for params, n, trained, kept in curs:
        step = int(re.search(r"step = (\d+)", json.loads(params)["where"]).group(1))
        per_step[step] = (int(n), int(trained or 0), int(kept))
    mu = job["epochs"]
    cum, tot = {0: (0, 0, 0, 0, 0)}, [0, 0, 0, 0, 0]
    for it in range(job["iterations"]):
        n, trained, kept = per_step.get(it, (0, 0, 0))
        rollouts, gen_tokens = gen.get(it, (0, 0))
        for k, v in enumerate((kept * mu, n * mu, rollouts, trained * mu, gen_tokens)):
            tot[k] += v
        cum[it + 1] = tuple(tot)
    points: dict[int, dict] = {}
    for it, metric, value, at in evals:
        points.setdefault(it, {"iteration": it})[metric] = value
        points[it]["_at"] = at
    curve = []
    for it in sorted(points):
        t, smp, g, tp, gt = cum[it]
        m = points[it]
        curve.append({**{k: v for k, v in m.items() if k != "_at"}, "learner_tokens": t, "learner_samples": smp,
                      "rollouts": g, "seconds": m["_at"] - start, "token_passes": tp, "generated_tokens": gt})
    return {**{k: job[k] for k in ("name", "recipe", "sets", "seed", "split", "lr", "epochs")}, "curve": curve,
            "learner_tokens": tot[0], "learner_samples": tot[1], "rollouts": tot[2], "token_passes": tot[3],
            "generated_tokens": tot[4], "wall_seconds": curve[-1]["seconds"], "loop_seconds": curve[-1]["seconds"],
            "phases": {}, "skips": [(int(a), int(b), int(c)) for a, b, c in skips],
            "skip_outcomes": _skip_outcomes(root), "buffer": root, "rebuilt": True}


def _learner_costs(root: str, summary: dict) -> dict[int, tuple[int, int]]:
    """iteration → (response tokens of the rows its curation selected, response tokens generated).
    A selected row costs one training forward and backward per pass, lagged (replayed) rows
    included: their π_prox is that forward's log-probs, not a forward of its own."""
    from rollstore.queries.session import Session
    from rollstore.storage.buffer import Buffer

    with Buffer.open(root) as buf, buf.snapshot() as snap, Session(snap) as s:
        sel = {cid: int(a or 0) for cid, a in s.execute(
            "SELECT curation_id, sum(tokens_total) FILTER (WHERE selected) FROM selections GROUP BY curation_id"
        ).fetchall()}
        gen = {int(st): int(n or 0) for st, n in s.execute(
            "SELECT step, sum(len(response_token_ids)) FROM rollouts GROUP BY step").fetchall()}
    return {r["iteration"]: (sel.get(r["curation_id"], 0), gen.get(r["iteration"], 0))
            for r in summary["iterations"]}


def _skip_outcomes(root: str) -> dict[str, int]:
    """How many skipped prompts were generated again later in the run, and how many of those groups
    were informative (queries/prompt_skip_outcomes.sql)."""
    from rollstore.queries import load_sql
    from rollstore.queries.session import Session
    from rollstore.storage.buffer import Buffer

    with Buffer.open(root) as buf, buf.snapshot() as snap, Session(snap) as s:
        n, informative = s.one(f"SELECT count(*), count(*) FILTER (WHERE next_informative) FROM "
                               f"({load_sql('prompt_skip_outcomes')})")
    return {"later_sampled": int(n), "informative": int(informative or 0)}


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def interval(values: list[float]) -> tuple[float, float, float] | None:
    """(mean, low, high): the mean with a 95 % Student-t interval (None without values)."""
    if not values:
        return None
    m = statistics.mean(values)
    if len(values) < 2:
        return m, m, m
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def fmt_interval(values: list[float], digits: int = 3) -> str:
    iv = interval(values)
    return "–" if iv is None else f"{iv[0]:.{digits}f} [{iv[1]:.{digits}f}, {iv[2]:.{digits}f}]"


def rollouts_to_reach(curve: list[dict], target: float, metric: str = "pass@1") -> float | None:
    """Rollouts generated when `metric` first reaches `target`, linear between evaluations (None: never)."""
    prev = None
    for point in curve:
        if point[metric] >= target:
            if prev is None or point[metric] == prev[metric]:
                return float(point["rollouts"])
            frac = (target - prev[metric]) / (point[metric] - prev[metric])
            return prev["rollouts"] + frac * (point["rollouts"] - prev["rollouts"])
        prev = point
    return None


def ratio_to_grpo(runs: list[dict], grpo: dict[int, dict], metric: str = "pass@1") -> tuple[str, list[float]]:
    """'rollouts to reach grpo's final' relative to grpo's, per seed, summarised (see the invariants);
    any other reference recipe's runs (by seed) in place of grpo's give the same against it."""
    ratios, missing = [], 0
    for r in runs:
        base = grpo.get(r["seed"])
        if base is None:
            continue
        target = base["curve"][-1][metric]
        mine, theirs = rollouts_to_reach(r["curve"], target, metric), rollouts_to_reach(base["curve"], target, metric)
        if mine is None:
            missing += 1
        elif theirs:
            ratios.append(max(mine, 1.0) / theirs)
    n = len(ratios) + missing
    if not ratios:
        return f"not reached (0/{n} seeds)", []
    iv = interval([math.log(x) for x in ratios])
    text = f"{math.exp(iv[0]):.2f}× [{math.exp(iv[1]):.2f}, {math.exp(iv[2]):.2f}]"
    if missing:
        text += f"; not reached in {missing}/{n} seeds"
    return text, ratios


def summarise(runs: list[dict], metric: str = "pass@1") -> list[list[str]]:
    """Rows of the results table (one per recipe; intervals over seeds, differences paired by seed)."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["name"], []).append(r)
    grpo = {r["seed"]: r for r in by.get("grpo", [])}
    rows = []
    for name in by:
        rs = by.get(name)
        if not rs:
            continue
        k = max(int(key.split("@")[1]) for key in rs[0]["curve"][-1] if key.startswith("pass@"))
        diffs = [r["curve"][-1][metric] - grpo[r["seed"]]["curve"][-1][metric] for r in rs if r["seed"] in grpo]
        ratio, _ = ratio_to_grpo(rs, grpo, metric) if name != "grpo" else ("1 (reference)", [])
        dapo = {r["seed"]: r for r in by.get("dapo", [])}
        vs_dapo = ("1 (reference)" if name == "dapo" else ratio_to_grpo(rs, dapo, metric)[0]) if dapo else "–"
        rows.append([
            name, str(len(rs)),
            fmt_interval([r["curve"][0][metric] for r in rs]),
            fmt_interval([r["curve"][-1][metric] for r in rs]),
            fmt_interval([r["curve"][-1][f"pass@{k}"] for r in rs]),
            fmt_interval(diffs) if name != "grpo" else "–",
            ratio,
            vs_dapo,
            f"{statistics.mean(r['rollouts'] for r in rs):,.0f}",
            f"{statistics.mean(r['learner_tokens'] for r in rs):,.0f}",
            f"{statistics.mean(r['wall_seconds'] for r in rs):.0f}",
        ])
    return rows


HEADER = ["recipe", "seeds", "start pass@1", "final pass@1 [95 % CI]", "final pass@k [95 % CI]",
          "final pass@1 − grpo (paired)", "rollouts to grpo's final pass@1, vs grpo [95 % CI]",
          "rollouts to dapo's final pass@1, vs dapo [95 % CI]", "rollouts generated", "learner tokens", "wall s/run"]


def plot(runs: list[dict], split: str, path: str) -> None:
    from rollstore.report.svg import Series, line_chart

    by = {}
    for r in runs:
        by.setdefault(r["name"], []).append(r)
    charts = []
    for x_key, x_label in (("rollouts", "rollouts generated"), ("learner_tokens", "learner tokens consumed")):
        series = []
        for name in by:
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
                                 x_label=x_label, y_label="pass@1", integer_x=True))
    # the report's chart classes, for a standalone file; the legend wraps: at most 4 recipes a chart line
    style = ("<style>svg{font-family:sans-serif}.ct{font-size:13px;font-weight:600}.tick{font-size:10.5px;fill:#555}"
             ".al{font-size:11px;fill:#555}.lg{font-size:11px}.grid{stroke:#e7eaee}.axis{stroke:#8a949e}</style>")
    body = "".join(f'<g transform="translate(0,{i * 270})">{c}</g>' for i, c in enumerate(charts))
    with open(path, "w") as fh:
        fh.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="540" height="{270 * len(charts)}">{style}{body}</svg>\n')


def efficiency_section(runs: list[dict], args, default_lr: float) -> str:
    """The tuned-baseline tables (bench.tuned): every configuration's cost to grpo@1's final on both
    axes, each recipe's best point, the paired comparison asked for, the Pareto SVG, skip statistics."""
    pts = tuned.points(runs, default_lr)
    svg = os.path.join(args.out, "pareto.svg")
    tuned.pareto_svg(pts, args.splits, svg)
    out = [f"Cost to the target (grpo@1 at lr {default_lr:g}: its final pass@1 per split and seed), linear between "
           f"evaluations; a configuration's mean counts only when it reached the target in every seed. "
           f"Pareto plot: [{os.path.relpath(svg, HERE)}]({os.path.relpath(svg, HERE)})", ""]
    bases = list(dict.fromkeys(p["base"] for p in pts.values()))
    for split in args.splits:
        out += [f"**{split} split: every configuration**", "", md_table(tuned.TABLE_HEADER, tuned.table_rows(pts, split)), ""]
        rows = []
        for b in bases:
            top = tuned.best(pts, split, b)
            if top:
                p = top[1]
                rows.append([b, top[0], f"{p['rollouts']:,.0f}", f"{p['token_passes']:,.0f}", f"{p['final']:.3f}"])
        out += [f"**{split} split: best point of each recipe** (fewest rollouts to the target)", "",
                md_table(["recipe", "best configuration", "rollouts", "token-passes", "final pass@1"], rows), ""]
        if args.compare:
            a, b = (tuned.best(pts, split, x) for x in args.compare)
            if a and b:
                out += [f"{split}: {a[0]} against {b[0]} (paired by seed): rollouts to the target "
                        f"{tuned.fmt_ratio(tuned.paired_ratio(a[1], b[1], 'rollouts'))}, token-passes "
                        f"{tuned.fmt_ratio(tuned.paired_ratio(a[1], b[1], 'token_passes'))}; final pass@1 "
                        f"{a[1]['final']:.3f} against {b[1]['final']:.3f}", ""]
        skips = [r for r in runs if r["split"] == split and r.get("skips")]
        if skips:
            examined = sum(n for r in skips for _, _, n in r["skips"])
            skipped = sum(k for r in skips for _, k, _ in r["skips"])
            later = sum(r["skip_outcomes"]["later_sampled"] for r in skips)
            wrong = sum(r["skip_outcomes"]["informative"] for r in skips)
            timed = [r for r in skips if r["phases"]]  # runs rebuilt from their buffers have no phases
            sel = sum(r["phases"].get("selection", 0.0) for r in timed)
            loop_s = sum(r["loop_seconds"] for r in timed)
            per_it = {}
            for r in skips:
                for it, k, n in r["skips"]:
                    per_it.setdefault(it, [0, 0])
                    per_it[it][0] += k
                    per_it[it][1] += n
            share = ", ".join(f"{it}: {k / n:.2f}" for it, (k, n) in sorted(per_it.items()))
            out += [f"{split}: pre-rollout selection examined {examined:,} prompts and skipped {skipped:,} "
                    f"({skipped / max(examined, 1):.1%}) over {len(skips)} runs; {later:,} skipped prompts were "
                    f"generated again later, and {wrong:,} of those groups were informative "
                    f"({wrong / max(later, 1):.1%}: the predictor was wrong); selection took {sel:.1f} s of "
                    f"{loop_s:.0f} s of loop ({sel / max(loop_s, 1e-9):.1%}, over the {len(timed)} runs timed in this "
                    f"process). Skip share per iteration (all runs): {share}", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 recipes, 1 seed, 2 iterations, tiny sizes")
    ap.add_argument("--splits", nargs="+", default=["train"], choices=sorted(SPLITS))
    ap.add_argument("--recipes", nargs="+", default=[c[0] for c in CONFIGS],
                    help="configurations: a recipe (built-in or named here), optionally @μ and ,lr=X (or lr=Nx: N × "
                         "the default) and ,param=value; e.g. grpo@2,lr=2e-4")
    ap.add_argument("--grid", nargs="*", default=None, metavar="RECIPE",
                    help="tune these recipes over μ × learning rate (--grid-epochs × --grid-lr), grpo@1 at the default "
                         "rate always included as the target; summarised with best points and a Pareto SVG")
    ap.add_argument("--grid-epochs", nargs="+", type=int, default=list(tuned.GRID_EPOCHS))
    ap.add_argument("--grid-lr", nargs="+", type=float, default=list(tuned.GRID_LR), help="multiples of the default rate")
    ap.add_argument("--compare", nargs=2, default=None, metavar=("RECIPE", "BASELINE"),
                    help="with --grid: the paired comparison of RECIPE's best point against BASELINE's")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--seed-start", type=int, default=0, help="first seed (runs seeds seed-start .. + seeds − 1)")
    ap.add_argument("--iterations", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=64, help="prompts per generation batch")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--pool-size", type=int, default=None, help="training prompt pool (default: the loop's)")
    ap.add_argument("--max-gen-batches", type=int, default=4, help="over-generation cap of filtering recipes")
    ap.add_argument("--lr", type=float, default=None, help="learning rate, the same for every recipe (default: the loop's)")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--eval-prompts", type=int, default=500)
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    ap.add_argument("--model", default=None, help="start model for every split (default: each split's built-in "
                                                    "policy: builtin:tiny, builtin:tiny-carries for carries)")
    ap.add_argument("--out", default=os.path.join(HERE, "learning"), help="where the JSON and SVG go")
    ap.add_argument("--root", default=None, help="where the run buffers go (default: a temporary directory)")
    ap.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    ap.add_argument("--reuse", action="store_true",
                    help="a run whose buffer under --root already holds its last evaluation is rebuilt from the "
                         "buffer instead of run again (its timings then come from the rows' timestamps)")
    ap.add_argument("--from-json", action="store_true",
                    help="do not run: rebuild tables and plots from the JSON curves already in --out")
    args = ap.parse_args(argv)
    if args.quick:
        args.recipes = args.recipes if args.recipes != [c[0] for c in CONFIGS] else ["grpo", "dapo"]
        args.seeds, args.iterations, args.prompts, args.eval_every = 1, 2, 8, 1
        args.eval_prompts, args.eval_samples, args.group_size, args.max_gen_batches = 16, 2, 4, 2
    from rollstore.curate.params import builtin_recipes
    from rollstore.loop import LoopConfig
    from rollstore.builtin.resolve import resolve_model

    defaults = LoopConfig(buffer="")
    lr = args.lr if args.lr is not None else defaults.train.lr
    named = {name: (recipe, sets) for name, recipe, sets in CONFIGS}
    specs = list(args.recipes) if args.grid is None else (["grpo"] + tuned.grid(args.grid, lr, args.grid_epochs,
                                                                                   [x for x in args.grid_lr]))
    try:
        configs = [tuned.parse_spec(x, lr, named) for x in dict.fromkeys(specs)]
    except ValueError as exc:
        ap.error(str(exc))
    unknown = {c["base"] for c in configs} - set(named) - set(builtin_recipes())
    if unknown:
        ap.error(f"unknown recipes {sorted(unknown)}; choose from {sorted(set(named) | set(builtin_recipes()))}")

    models = {split: resolve_model(args.model or SPLITS[split][2]) for split in args.splits}
    os.makedirs(args.out, exist_ok=True)
    out_root = args.root or ("" if args.from_json else tempfile.mkdtemp(prefix="rollstore-learning-"))
    tasks = ", ".join(dict.fromkeys(":".join(SPLITS[s][0].split(":")[:2]) for s in args.splits))
    head = header(f"Learning: recipes compared on {tasks} (bench/learning.py)",
                  libs=("torch", "transformers", "duckdb", "pyarrow"))  # load average taken at the start
    t0 = time.perf_counter()
    pool_size = args.pool_size if args.pool_size is not None else defaults.pool_size
    jobs = [
        {"name": c["name"], "recipe": c["recipe"], "sets": c["sets"], "seed": seed, "split": split, "model": models[split],
         "iterations": args.iterations, "prompts": args.prompts, "group_size": args.group_size, "lr": c["lr"],
         "micro_batch": defaults.train.micro_batch_size, "grad_accum": defaults.train.grad_accum,
         "warmup": defaults.train.warmup_steps, "epochs": c["epochs"], "eval_every": args.eval_every,
         "eval_prompts": args.eval_prompts, "eval_samples": args.eval_samples, "pool_size": pool_size,
         "max_gen_batches": args.max_gen_batches, "out_root": out_root, "reuse": args.reuse}
        for split in args.splits for seed in range(args.seed_start, args.seed_start + args.seeds) for c in configs
    ]
    runs = []
    if args.from_json:
        for split in args.splits:
            with open(os.path.join(args.out, f"learning-{split}.json")) as fh:
                runs += json.load(fh)
        wall = sum(r["wall_seconds"] for r in runs) / max(1, args.jobs)
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=mp.get_context("spawn")) as pool:
            for r in pool.map(run_one, jobs):
                last = r["curve"][-1]
                print(f"{r['split']:7s} {r['name']:22s} seed {r['seed']}: pass@1 {r['curve'][0]['pass@1']:.3f} → "
                      f"{last['pass@1']:.3f}, greedy {r['curve'][0]['greedy_accuracy']:.3f} → "
                      f"{last['greedy_accuracy']:.3f}, {r['rollouts']:,} rollouts, {r['learner_tokens']:,} learner "
                      f"tokens, {r['wall_seconds']:.0f} s", flush=True)
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
        table = md_table(HEADER, summarise(rs))
        print(f"\n{split} split\n{table}")
        sections.append((split, table, os.path.relpath(svg, HERE)))
    efficiency = efficiency_section(runs, args, lr) if any(tuned.is_reference(r, lr) for r in runs) else ""
    if efficiency:
        print("\n" + efficiency)
    if not args.no_record and not args.quick:
        lines = [
            f"Configuration: {args.seeds} paired seeds × {len(args.recipes)} recipes per split, {args.iterations} "
            f"iterations; each iteration generates a first batch of {args.prompts} prompts × {args.group_size} samples "
            f"from a pool of {pool_size} training prompts in epochs (the same batch for every recipe of a seed); "
            f"filtering recipes then over-generate batches of the same size until {args.prompts} groups survive, at "
            f"most {args.max_gen_batches} batches. " + (f"lr {lr:g} and μ 1 for every recipe (not tuned per recipe)"
            if all(c["lr"] == lr and c["epochs"] == 1 for c in configs) else
            f"learning rate and μ (passes per batch) as each configuration's name says (grpo: lr {lr:g}, μ 1)")
            + f", micro-batch "
            f"{defaults.train.micro_batch_size} × accumulation {defaults.train.grad_accum}, loss {defaults.train.loss}; held-out: "
            f"{args.eval_prompts} distinct prompts × {args.eval_samples} samples at T={defaults.generation.temperature} every "
            f"{args.eval_every} iterations. Start model: "
            f"{', '.join(f'{s}: {args.model or SPLITS[s][2]}' for s in args.splits)}. {len(runs)} runs in {wall / 60:.1f} min wall with "
            f"{args.jobs} parallel jobs" + (" (sum of run times / jobs: rebuilt with --from-json)." if args.from_json else "."),
            "",
        ]
        for split, table, svg in sections:
            lines += [f"**{split} split** — intervals are 95 % Student-t intervals over seeds; 'final pass@1 − grpo' is "
                      f"paired by seed; the rollouts ratio is the geometric mean over seeds of (rollouts until pass@1 "
                      f"first reaches that seed's grpo final) / (grpo's own), linear between evaluations. "
                      f"Plot: [{svg}]({svg})", "", table, ""]
        if efficiency:
            lines += [efficiency, ""]
        append_results(head + "\n\n" + "\n".join(lines))
    print(f"\n{len(runs)} runs in {wall:.0f} s; buffers under {out_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
