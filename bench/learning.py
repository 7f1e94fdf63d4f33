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
- A `--root` folder holds runs of one configuration: its `bench-config.json` (the fingerprint:
  everything but the recipe, μ, lr and seed, which name each run's folder; a built-in start policy
  by its cache key, so a policy whose build changed is another configuration) is written by the first
  invocation and checked by every later one; a mismatch is refused before anything runs. A
  finished run leaves `bench-run.json` (its whole result, phase seconds included) in its folder, so
  `--reuse` resumes a grid interrupted or run in parts (`--part I/N`) without rerunning a finished run.
- Learner positions (`training.positions`: what the learner forwarded and backwarded, as run) and
  the loop's seconds split into generate (selection, generation, reward, scoring, append), curate
  and train (optimiser steps, publish) are cumulative per evaluation like every other cost.

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
# split → (training prompts, held-out split, start model[, max new tokens]); without the fourth
# entry a split generates (and evaluates) DEFAULT_MAX_NEW_TOKENS; `--max-new-tokens SPLIT=N` overrides.
SPLITS: dict[str, tuple] = {
    "train": ("builtin:arith", "heldout", "builtin:tiny"),
    "harder": ("builtin:arith:harder", "heldout-harder", "builtin:tiny"),
    "carries": ("builtin:carries", "heldout", "builtin:tiny-carries"),  # three digits, levels 0–3 carries
    "chains": ("builtin:chains", "heldout", "builtin:tiny-chains"),  # the working written out, 29–33 tokens
}
DEFAULT_MAX_NEW_TOKENS = 8
# the phases of `IterationReport.phases` (rollstore.loop.driver.PHASES) in each part of the loop's seconds
SECONDS_PARTS = {"generate_seconds": ("selection", "generation", "reward", "scoring", "append"),
                 "curate_seconds": ("curation",), "train_seconds": ("optimiser", "publish")}
RUN_FILE, CONFIG_FILE = "bench-run.json", "bench-config.json"


def max_new_tokens(split: str, overrides: dict[str, int] | None = None) -> int:
    """The generation budget of `split`: the override, else SPLITS' fourth entry, else its task's
    (`task_max_new_tokens`: 40 on builtin:chains), else the default."""
    from rollstore.builtin.resolve import task_max_new_tokens

    if overrides and split in overrides:
        return overrides[split]
    entry = SPLITS[split]
    return int(entry[3]) if len(entry) > 3 else task_max_new_tokens(entry[0], DEFAULT_MAX_NEW_TOKENS)


def run_folder(job: dict) -> str:
    return os.path.join(job["out_root"], f"{job['split']}-{job['name']}-s{job['seed']}")


def claim_run_folder(root: str):
    """An exclusive lock on the run folder `root` (a file beside it: the folder itself may be removed
    and made again), held until the returned file is closed or its process ends. A second process
    that would run the same configuration in the same folder (a killed driver's pool worker still
    running, a second invocation on the same --root) is refused in one line instead of removing the
    folder under the first."""
    import fcntl

    os.makedirs(os.path.dirname(root) or ".", exist_ok=True)
    fh = open(root + ".lock", "w")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise BenchError(f"{root}: another process is running this configuration (lock {root}.lock held)")
    return fh


def _one_line_refusals(results):
    """The runs' results; a run refused by a `BenchError` (its folder locked by another process) ends
    the bench with that one line on stderr and exit status 2, not a worker's traceback."""
    try:
        yield from results
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def run_one(job: dict) -> dict:
    """One loop run (in a worker process): its evaluation curve, consumption and wall time; the
    run folder is locked for the run's whole time (`claim_run_folder`)."""
    with claim_run_folder(run_folder(job)):
        return _run_one(job)


def _run_one(job: dict) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    from rollstore.learner.config import TrainConfig
    from rollstore.loop.generate import GenerationConfig
    from rollstore.loop import LoopConfig, run_loop
    from rollstore.storage.buffer import Buffer

    root = run_folder(job)
    if job.get("reuse"):
        done = finished(root, job)
        if done is not None:
            return done
    if os.path.exists(root):
        import shutil

        shutil.rmtree(root)
    Buffer.init(root).close()
    cfg = LoopConfig(
        buffer=root, model=job["model"], prompts=SPLITS[job["split"]][0], recipe=job["recipe"],
        sets=dict(job["sets"]), iterations=job["iterations"], prompts_per_iter=job["prompts"],
        generation=GenerationConfig(group_size=job["group_size"], max_new_tokens=job["max_new_tokens"]),
        train=TrainConfig(lr=job["lr"], micro_batch_size=job["micro_batch"], grad_accum=job["grad_accum"],
                          warmup_steps=job["warmup"], pack=job.get("pack", True)),
        eval_every=job["eval_every"], eval_prompts=job["eval_prompts"],
        eval_split=SPLITS[job["split"]][1], eval_samples=job["eval_samples"], eval_ks=(1, job["eval_samples"]),
        overgen=1, max_gen_batches=job["max_gen_batches"], pool_size=job["pool_size"], seed=job["seed"],
        run_id=f"{job['name']}-s{job['seed']}", epochs=job["epochs"], lr=job["lr"],
    )
    t0 = time.perf_counter()
    summary = run_loop(cfg)
    wall = time.perf_counter() - t0
    costs = _learner_costs(root, summary)
    tot = dict.fromkeys(("learner_tokens", "learner_samples", "rollouts", "seconds", "token_passes",
                         "generated_tokens", "learner_positions", *SECONDS_PARTS), 0)
    cum = {0: dict(tot)}
    for rep in summary["iterations"]:
        trained, gen_tokens = costs[rep["iteration"]]
        tot["learner_tokens"] += rep["tokens_kept"] * summary["epochs"]
        tot["learner_samples"] += rep["samples_kept"] * summary["epochs"]
        tot["token_passes"] += trained * summary["epochs"]
        tot["learner_positions"] += rep["positions"]  # as run: every pass of every epoch
        tot["rollouts"] += rep["rollouts"]
        tot["generated_tokens"] += gen_tokens
        tot["seconds"] += rep["seconds"]
        for part, names in SECONDS_PARTS.items():
            tot[part] += sum(rep["phases"].get(n, 0.0) for n in names)
        cum[rep["iteration"] + 1] = dict(tot)
    curve = [{**m, **cum[m["iteration"]]} for m in summary["eval_metrics"]]
    phases: dict[str, float] = {}
    for rep in summary["iterations"]:
        for k, v in rep["phases"].items():
            phases[k] = phases.get(k, 0.0) + v
    result = {**{k: job[k] for k in ("name", "recipe", "sets", "seed", "split", "lr", "epochs")}, "curve": curve,
              **{k: tot[k] for k in ("learner_tokens", "learner_samples", "rollouts", "token_passes",
                                     "generated_tokens", "learner_positions")},
              "wall_seconds": wall, "phases": phases, "loop_seconds": tot["seconds"],
              "skips": summary["skips"], "skip_outcomes": _skip_outcomes(root), "buffer": root}
    with open(os.path.join(root, RUN_FILE + ".tmp"), "w") as fh:
        json.dump(result, fh)
    os.replace(os.path.join(root, RUN_FILE + ".tmp"), os.path.join(root, RUN_FILE))
    return result


def packed_positions(buf, curation_ids: list[str], micro_batch: int, epochs: int) -> dict[str, int]:
    """curation id → the learner positions the packed learner forwards and backwards for its rows over
    `epochs` passes, computed from its curated shards with the learner's own batching
    (`iter_rank_steps`, one process) — for runs trained before `training.positions` was recorded,
    whose learner was mathematically the same (tests/test_packing.py) but forwarded whole rows. Exact
    when a curation's rows fit one optimiser step (≤ micro_batch rows: every pass packs alike); above
    that, which rows share a step follows the learner's per-pass shuffle, which this does not replay."""
    from rollstore.learner.batches import iter_rank_steps, read_curated
    from rollstore.learner.consume import shard_curation_id

    wanted, paths = set(curation_ids), {}
    for shard in buf.manifest.shards("curated"):
        cid = shard_curation_id(shard)
        if cid in wanted:
            paths.setdefault(cid, []).append(os.path.join(buf.root, shard.path))
    out = {cid: 0 for cid in curation_ids}
    for cid, files in paths.items():
        rows = read_curated(sorted(files))
        one = sum(b.positions_run for st in iter_rank_steps(rows, micro_batch) for b in st.micro)
        out[cid] = one * epochs
    return out


def finished(root: str, job: dict) -> dict | None:
    """A finished run of `job` under `root`: its `bench-run.json`, else rebuilt from its buffer
    (`from_buffer`); None when it did not reach its last evaluation."""
    path = os.path.join(root, RUN_FILE)
    if os.path.exists(path):
        with open(path) as fh:
            result = json.load(fh)
        if result["curve"] and result["curve"][-1]["iteration"] >= job["iterations"]:
            return {**result, "buffer": root, "reused": True}
    return from_buffer(root, job)


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
        curs = s.execute("SELECT c.params, s.n, s.trained, c.tokens_kept, c.curation_id FROM curations c JOIN (SELECT "
                         "curation_id, count(*) FILTER (WHERE selected) AS n, sum(tokens_total) FILTER (WHERE selected) "
                         "AS trained FROM selections GROUP BY curation_id) s USING (curation_id)").fetchall()
        gen = {int(st): (int(n), int(t or 0)) for st, n, t in s.execute(
            "SELECT step, count(*), sum(len(response_token_ids)) FROM rollouts GROUP BY step").fetchall()}
        start = s.one("SELECT epoch(min(created_at)) FROM rollouts")[0]
        skips = s.execute("SELECT step, count(*) FILTER (WHERE decision = 'skip'), count(*) FROM prompt_selections "
                          "GROUP BY step ORDER BY step").fetchall()
        # learner positions per curation (null: training rows written before the column)
        try:
            pos = {cid: (None if p is None else int(p)) for cid, p in s.execute(
                "SELECT curation_id, sum(positions) FROM training GROUP BY curation_id").fetchall()}
        except Exception:  # noqa: BLE001  (every training shard written before the column: no such column)
            pos = {}
        missing = [cid for *_, cid in curs if pos.get(cid) is None]
        if missing:  # trained before training.positions existed: what the packed learner forwards for them
            pos.update(packed_positions(buf, missing, job["micro_batch"], job["epochs"]))
    per_step = {}
    for params, n, trained, kept, cid in curs:
        step = int(re.search(r"step = (\d+)", json.loads(params)["where"]).group(1))
        per_step[step] = (int(n), int(trained or 0), int(kept), pos.get(cid, 0))
    mu = job["epochs"]
    cum, tot = {0: (0, 0, 0, 0, 0, 0)}, [0, 0, 0, 0, 0, 0]
    for it in range(job["iterations"]):
        n, trained, kept, positions = per_step.get(it, (0, 0, 0, 0))
        rollouts, gen_tokens = gen.get(it, (0, 0))
        for k, v in enumerate((kept * mu, n * mu, rollouts, trained * mu, gen_tokens)):
            tot[k] += v
        tot[5] = None if positions is None or tot[5] is None else tot[5] + positions
        cum[it + 1] = tuple(tot)
    points: dict[int, dict] = {}
    for it, metric, value, at in evals:
        points.setdefault(it, {"iteration": it})[metric] = value
        points[it]["_at"] = at
    curve = []
    for it in sorted(points):
        t, smp, g, tp, gt, lp = cum[it]
        m = points[it]
        curve.append({**{k: v for k, v in m.items() if k != "_at"}, "learner_tokens": t, "learner_samples": smp,
                      "rollouts": g, "seconds": m["_at"] - start, "token_passes": tp, "generated_tokens": gt,
                      **({} if lp is None else {"learner_positions": lp})})
    return {**{k: job[k] for k in ("name", "recipe", "sets", "seed", "split", "lr", "epochs")}, "curve": curve,
            "learner_tokens": tot[0], "learner_samples": tot[1], "rollouts": tot[2], "token_passes": tot[3],
            "generated_tokens": tot[4], "learner_positions": tot[5],
            "wall_seconds": curve[-1]["seconds"], "loop_seconds": curve[-1]["seconds"],
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
            _mean_or_dash([r.get("learner_positions") for r in rs]),
            f"{statistics.mean(r['wall_seconds'] for r in rs):.0f}",
        ])
    return rows


HEADER = ["recipe", "seeds", "start pass@1", "final pass@1 [95 % CI]", "final pass@k [95 % CI]",
          "final pass@1 − grpo (paired)", "rollouts to grpo's final pass@1, vs grpo [95 % CI]",
          "rollouts to dapo's final pass@1, vs dapo [95 % CI]", "rollouts generated", "learner tokens",
          "learner positions", "wall s/run"]


def _mean_or_dash(values: list) -> str:
    return "–" if any(v is None for v in values) or not values else f"{statistics.mean(values):,.0f}"


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
    """The tuned-baseline tables (bench.tuned): every configuration's costs to both targets (grpo@1's
    final, and 97 % of the best tuned grpo's own final), each recipe's best point against the best
    tuned grpo paired by seed, the Pareto SVG (rollouts × learner positions), skip statistics."""
    pts = tuned.points(runs, default_lr)
    pts97 = tuned.points(runs, default_lr, tuned.share_targets(pts))
    svg = os.path.join(args.out, "pareto.svg")
    tuned.pareto_svg([(split, label, p) for split in args.splits
                      for label, p in (("grpo@1's final", pts), ("97 % of best grpo's final", pts97))], svg)
    out = [f"Costs to two targets per split and seed, linear between evaluations: grpo@1's final pass@1 (lr "
           f"{default_lr:g}), and {tuned.TARGET_SHARE:.0%} of the final pass@1 of the best tuned grpo (grpo's best "
           f"point on the first target); a configuration's mean counts only when it reached the target in every "
           f"seed. Learner positions: what the learner forwarded and backwarded, as run (training.positions). "
           f"Pareto plot (rollouts × learner positions, both targets): "
           f"[{os.path.relpath(svg, HERE)}]({os.path.relpath(svg, HERE)})", ""]
    for split in args.splits:
        out += [f"**{split} split: every configuration**", "",
                md_table(tuned.TABLE_HEADER, tuned.table_rows(pts, split, pts97)), ""]
        out += [f"**{split} split: each recipe's best point** (fewest rollouts to grpo@1's final) against the best "
                f"tuned grpo, paired by seed (95 % t-intervals)", "",
                md_table(tuned.BEST_HEADER, tuned.best_rows(pts, pts97, split)), ""]
        if args.compare:
            a, b = (tuned.best(pts, split, x) for x in args.compare)
            if a and b:
                out += [f"{split}: {a[0]} against {b[0]} (paired by seed): rollouts to the target "
                        f"{tuned.fmt_ratio(tuned.paired_ratio(a[1], b[1], 'rollouts'))}, learner positions "
                        f"{tuned.fmt_ratio(tuned.paired_ratio(a[1], b[1], 'learner_positions'))}, token-passes "
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


class BenchError(Exception):
    """Bad input to the bench: one line, nothing run."""


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (exit status 2), without the usage block."""

    def error(self, message: str):
        print(f"bench.learning: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> _Parser:
    ap = _Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 recipes, 1 seed, 2 iterations, tiny sizes")
    ap.add_argument("--splits", nargs="+", default=["train"],
                    help=f"which splits (tasks) to run: {', '.join(SPLITS)}")
    ap.add_argument("--recipes", nargs="+", default=[c[0] for c in CONFIGS],
                    help="configurations: a recipe (built-in or named here), optionally @μ and ,lr=X (or lr=Nx: N × "
                         "the default) and ,param=value; e.g. grpo@2,lr=2e-4")
    ap.add_argument("--grid", nargs="*", default=None, metavar="RECIPE",
                    help="tune these recipes over μ × learning rate (--grid-epochs × --grid-lr), grpo@1 at the default "
                         "rate always included as the target; summarised with best points and a Pareto SVG")
    ap.add_argument("--grid-epochs", nargs="+", type=int, default=list(tuned.GRID_EPOCHS),
                    help=f"μ values of the grid, each in {tuned.EPOCHS_RANGE[0]}..{tuned.EPOCHS_RANGE[1]}")
    ap.add_argument("--grid-lr", nargs="+", type=float, default=list(tuned.GRID_LR),
                    help=f"multiples of the default rate, each in [{tuned.LR_RANGE[0]:g}, {tuned.LR_RANGE[1]:g}]")
    ap.add_argument("--best", default=None, metavar="GRID_OUT",
                    help="run each recipe's best point of the grid whose --out folder (learning-<split>.json) is "
                         "GRID_OUT, with grpo@1 at the default rate, on --seeds paired seeds")
    ap.add_argument("--best-target", choices=("grpo1", "97"), default="grpo1",
                    help="with --best: a recipe's best point is its fewest rollouts to grpo@1's final (grpo1) or to "
                         "97 %% of the best tuned grpo's own final (97)")
    ap.add_argument("--part", default=None, metavar="I/N",
                    help="run only part I of N of the runs (every N-th, from the I-th); needs --root. Run the parts, "
                         "then the whole command with --reuse to summarise")
    ap.add_argument("--max-new-tokens", nargs="+", default=[], metavar="SPLIT=N",
                    help=f"generation budget of a split (default: its SPLITS entry, else {DEFAULT_MAX_NEW_TOKENS})")
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
    ap.add_argument("--root", default=None, help="where the run buffers go (default: a temporary directory); it "
                                                   "holds runs of one configuration (bench-config.json)")
    ap.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    ap.add_argument("--reuse", action="store_true",
                    help="a run whose folder under --root already holds its last evaluation is taken from it "
                         "(bench-run.json, else rebuilt from its buffer) instead of run again")
    ap.add_argument("--no-pack", action="store_true",
                    help="train every row whole, in the loader's order (the learner before packing; to compare "
                         "learner positions)")
    ap.add_argument("--from-json", action="store_true",
                    help="do not run: rebuild tables and plots from the JSON curves already in --out")
    return ap


def _budgets(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        split, eq, n = item.partition("=")
        if not eq or split not in SPLITS or not n.isdigit() or not 1 <= int(n) <= 4096:
            raise BenchError(f"--max-new-tokens {item!r}: expected SPLIT=N with SPLIT one of {', '.join(SPLITS)} "
                             "and N in 1..4096")
        out[split] = int(n)
    return out


def check_tasks(splits: list[str], model: str | None) -> None:
    """Every split's training and held-out prompts resolve, and its start model is a built-in policy
    or a directory (building a policy is left to the runs): else one line naming the split."""
    from rollstore.builtin.resolve import TINY_MODELS, resolve_prompts

    for split in splits:
        prompts, heldout, start = SPLITS[split][:3]
        try:
            resolve_prompts(prompts, 2, seed=0, split="train")
            resolve_prompts(prompts, 2, split=heldout)
        except Exception as exc:  # noqa: BLE001  (whatever the resolver raises, as one line)
            first = (str(exc) or type(exc).__name__).splitlines()[0]
            raise BenchError(f"split {split!r}: task {prompts!r} (held-out {heldout!r}) does not resolve: {first}")
        ref = model or start
        if ref not in TINY_MODELS and not os.path.isdir(ref):
            raise BenchError(f"split {split!r}: start model {ref!r} is neither a built-in policy "
                             f"({', '.join(TINY_MODELS)}) nor a directory")


def fingerprint(args, lr: float, defaults, splits: list[str], budgets: dict[str, int]) -> dict:
    """What every run under one --root shares (the recipe, μ, lr and seed name each run's folder)."""
    return {
        "iterations": args.iterations, "prompts": args.prompts, "group_size": args.group_size,
        "pool_size": args.pool_size if args.pool_size is not None else defaults.pool_size,
        "max_gen_batches": args.max_gen_batches, "eval_every": args.eval_every, "eval_prompts": args.eval_prompts,
        "eval_samples": args.eval_samples, "default_lr": lr, "micro_batch": defaults.train.micro_batch_size,
        "grad_accum": defaults.train.grad_accum, "warmup": defaults.train.warmup_steps, "pack": not args.no_pack,
        "splits": {s: {"task": list(SPLITS[s][:2]), "model": model_key(args.model or SPLITS[s][2]),
                       "max_new_tokens": max_new_tokens(s, budgets)} for s in splits},
    }


def model_key(ref: str) -> str:
    """A start model as the fingerprint names it: a built-in policy with its cache key (which hashes
    everything that determines its weights; computed, not built), a directory by its absolute path."""
    from rollstore.builtin.resolve import TINY_MODELS, tiny_dir, tiny_spec

    if ref in TINY_MODELS:
        return f"{ref} ({os.path.basename(tiny_dir(tiny_spec(task=TINY_MODELS[ref])))})"
    return os.path.abspath(ref)


def claim_root(root: str, fp: dict) -> None:
    """Bind `root` to the configuration `fp`, or refuse (one line) a folder holding another one's
    runs: a different fingerprint, or runs without any. Splits not yet in the folder are added."""
    path = os.path.join(root, CONFIG_FILE)
    if os.path.exists(path):
        with open(path) as fh:
            held = json.load(fh)
        diff = [f"{k} {held.get(k)!r} there, {v!r} here" for k, v in fp.items() if k != "splits" and held.get(k) != v]
        diff += [f"split {s}: {held['splits'][s]} there, {v} here" for s, v in fp["splits"].items()
                 if s in held.get("splits", {}) and held["splits"][s] != v]
        if diff:
            raise BenchError(f"{root}: holds runs of another configuration ({'; '.join(diff)}); use another --root")
        fp = {**fp, "splits": {**held.get("splits", {}), **fp["splits"]}}
    elif os.path.isdir(root) and any(os.path.isdir(os.path.join(root, d)) for d in os.listdir(root)):
        raise BenchError(f"{root}: holds runs but no {CONFIG_FILE}: not a folder of this bench's configuration; "
                         "use another --root")
    os.makedirs(root, exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        json.dump(fp, fh, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def best_specs(folder: str, splits: list[str], lr: float, target: str) -> dict[str, list[str]]:
    """split → grpo (the reference) and each recipe's best point in the grid results under `folder`."""
    specs = {}
    for split in splits:
        path = os.path.join(folder, f"learning-{split}.json")
        if not os.path.exists(path):
            raise BenchError(f"--best {folder}: no {os.path.basename(path)} (run the grid on split {split!r} with "
                             f"--out {folder} first)")
        with open(path) as fh:
            runs = json.load(fh)
        pts = tuned.points(runs, lr)
        if target == "97":
            pts = tuned.points(runs, lr, tuned.share_targets(pts))
        if not pts:
            raise BenchError(f"{path}: no grpo@1 run at lr {lr:g}: no target to choose best points by")
        names = [top[0] for b in dict.fromkeys(p["base"] for p in pts.values()) if (top := tuned.best(pts, split, b))]
        specs[split] = list(dict.fromkeys(["grpo", *names]))
    return specs


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.recipes = args.recipes if args.recipes != [c[0] for c in CONFIGS] else ["grpo", "dapo"]
        args.seeds, args.iterations, args.prompts, args.eval_every = 1, 2, 8, 1
        args.eval_prompts, args.eval_samples, args.group_size, args.max_gen_batches = 16, 2, 4, 2
    from rollstore.curate.params import builtin_recipes
    from rollstore.loop import LoopConfig

    defaults = LoopConfig(buffer="")
    lr = args.lr if args.lr is not None else defaults.train.lr
    named = {name: (recipe, sets) for name, recipe, sets in CONFIGS}
    try:
        unknown_splits = [s for s in args.splits if s not in SPLITS]
        if unknown_splits:
            raise BenchError(f"unknown split {unknown_splits[0]!r}; choose from {', '.join(SPLITS)}")
        lo, hi = tuned.EPOCHS_RANGE
        bad = [m for m in args.grid_epochs if not lo <= m <= hi]
        if bad:
            raise BenchError(f"--grid-epochs {bad[0]}: μ must be in {lo}..{hi}")
        lo, hi = tuned.LR_RANGE
        bad = [k for k in args.grid_lr if not (lo <= k <= hi)]
        if bad:
            raise BenchError(f"--grid-lr {bad[0]:g}: a multiple of the default rate must be in [{lo:g}, {hi:g}]")
        if args.part is not None:
            i, _, n = args.part.partition("/")
            if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
                raise BenchError(f"--part {args.part!r}: expected I/N with 1 ≤ I ≤ N")
            if not args.root:
                raise BenchError("--part needs --root (the folder the parts share)")
        budgets = _budgets(args.max_new_tokens)
        known = set(named) | set(builtin_recipes())
        for name in (args.grid or []) + ([] if args.grid is not None else list(args.recipes)):
            base = name.split(",")[0].split("@")[0]
            if base not in known:
                raise BenchError(f"unknown recipe {base!r}; choose from {', '.join(sorted(known))}")
        if args.best:
            by_split = best_specs(args.best, args.splits, lr, args.best_target)
        else:
            specs = list(args.recipes) if args.grid is None else (["grpo"] + tuned.grid(
                args.grid, lr, args.grid_epochs, args.grid_lr))
            by_split = {split: list(dict.fromkeys(specs)) for split in args.splits}
        try:
            configs = {split: [tuned.parse_spec(x, lr, named) for x in specs] for split, specs in by_split.items()}
        except ValueError as exc:
            raise BenchError(str(exc))
        unknown = {c["base"] for cs in configs.values() for c in cs} - known
        if unknown:
            raise BenchError(f"unknown recipe {sorted(unknown)[0]!r}; choose from {', '.join(sorted(known))}")
        if not args.from_json:
            check_tasks(args.splits, args.model)
            if args.root:
                claim_root(args.root, fingerprint(args, lr, defaults, args.splits, budgets))
    except BenchError as exc:
        ap.error(str(exc))
    from rollstore.builtin.resolve import resolve_model

    os.makedirs(args.out, exist_ok=True)
    models = {} if args.from_json else {split: resolve_model(args.model or SPLITS[split][2]) for split in args.splits}
    out_root = args.root or ("" if args.from_json else tempfile.mkdtemp(prefix="rollstore-learning-"))
    tasks = ", ".join(dict.fromkeys(":".join(SPLITS[s][0].split(":")[:2]) for s in args.splits))
    head = header(f"Learning: recipes compared on {tasks} (bench/learning.py)",
                  libs=("torch", "transformers", "duckdb", "pyarrow"))  # load average taken at the start
    t0 = time.perf_counter()
    pool_size = args.pool_size if args.pool_size is not None else defaults.pool_size
    jobs = [
        {"name": c["name"], "recipe": c["recipe"], "sets": c["sets"], "seed": seed, "split": split,
         "model": models.get(split), "iterations": args.iterations, "prompts": args.prompts,
         "group_size": args.group_size, "lr": c["lr"], "max_new_tokens": max_new_tokens(split, budgets),
         "micro_batch": defaults.train.micro_batch_size, "grad_accum": defaults.train.grad_accum,
         "warmup": defaults.train.warmup_steps, "epochs": c["epochs"], "eval_every": args.eval_every,
         "eval_prompts": args.eval_prompts, "eval_samples": args.eval_samples, "pool_size": pool_size,
         "max_gen_batches": args.max_gen_batches, "out_root": out_root, "reuse": args.reuse,
         "pack": not args.no_pack}
        for split in args.splits for seed in range(args.seed_start, args.seed_start + args.seeds)
        for c in configs[split]
    ]
    if args.part is not None:
        i, n = (int(x) for x in args.part.split("/"))
        jobs = jobs[i - 1::n]
    runs = []
    if args.from_json:
        for split in args.splits:
            with open(os.path.join(args.out, f"learning-{split}.json")) as fh:
                runs += json.load(fh)
        wall = sum(r["wall_seconds"] for r in runs) / max(1, args.jobs)
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=mp.get_context("spawn")) as pool:
            for r in _one_line_refusals(pool.map(run_one, jobs)):
                last = r["curve"][-1]
                positions = r.get("learner_positions")
                print(f"{r['split']:7s} {r['name']:22s} seed {r['seed']}: pass@1 {r['curve'][0]['pass@1']:.3f} → "
                      f"{last['pass@1']:.3f}, greedy {r['curve'][0]['greedy_accuracy']:.3f} → "
                      f"{last['greedy_accuracy']:.3f}, {r['rollouts']:,} rollouts, {r['learner_tokens']:,} learner "
                      f"tokens, {'–' if positions is None else format(positions, ',')} learner positions, "
                      f"{r['wall_seconds']:.0f} s" + (" (reused)" if r.get("reused") or r.get("rebuilt") else ""),
                      flush=True)
                runs.append(r)
        wall = time.perf_counter() - t0
        if args.part is not None:
            print(f"\npart {args.part}: {len(runs)} runs in {wall:.0f} s under {out_root}; run the whole command "
                  "with --reuse to summarise")
            return 0
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
            f"Configuration: {args.seeds} paired seeds × {max(len(c) for c in configs.values())} configurations per "
            f"split, {args.iterations} "
            f"iterations; each iteration generates a first batch of {args.prompts} prompts × {args.group_size} samples "
            f"from a pool of {pool_size} training prompts in epochs (the same batch for every recipe of a seed); "
            f"filtering recipes then over-generate batches of the same size until {args.prompts} groups survive, at "
            f"most {args.max_gen_batches} batches. " + (f"lr {lr:g} and μ 1 for every recipe (not tuned per recipe)"
            if all(c["lr"] == lr and c["epochs"] == 1 for cs in configs.values() for c in cs) else
            f"learning rate and μ (passes per batch) as each configuration's name says (grpo: lr {lr:g}, μ 1)")
            + f", micro-batch "
            f"{defaults.train.micro_batch_size} × accumulation {defaults.train.grad_accum}, loss {defaults.train.loss}; held-out: "
            f"{args.eval_prompts} distinct prompts × {args.eval_samples} samples at T={defaults.generation.temperature} every "
            f"{args.eval_every} iterations; at most "
            f"{', '.join(f'{s}: {max_new_tokens(s, budgets)}' for s in args.splits)} new tokens. Start model: "
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
