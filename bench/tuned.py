"""The tuned baseline of bench/learning.py: configurations written `recipe@μ,lr=X`, the grid of μ ×
learning rate every recipe is tuned over, the two cost axes to a fixed target, each recipe's best
point and the Pareto picture.

Invariants:
- A configuration is a recipe (built-in or one of bench.learning's named variants), μ (passes per
  curated batch) and a learning rate; `lr=4x` is 4 × the loop's default. Its name is canonical:
  `grpo@2,lr=0.0002`; the bare recipe name means μ 1 at the default rate.
- Two targets per (split, seed). `grpo1`: the final pass@1 of grpo@1 at the loop's default rate on
  that split and seed — fixed, whatever else runs. `97`: 97 % of the final pass@1 of the best tuned
  grpo (grpo's best point on `grpo1`) on that split and seed — where a recipe that keeps training
  after it has learned what it can shows its waste. A run's cost to a target is linear between
  evaluations, on every axis (`COSTS`): generated rollouts; learner token-passes (response tokens of
  every row trained, per pass; a lagged row's π_prox comes from its training forward, no pass of
  its own); learner positions (what the learner forwarded and backwarded, as run: `training.positions`);
  loop seconds (whole iterations, held-out evaluations included), and their generate / curate / train
  parts (bench.learning.SECONDS_PARTS: evaluation and the rest are in none of them). Token-passes in bench/RESULTS.md sections
  recorded up to 2026-12-03, when the trainer still ran a separate π_prox forward, also count that
  forward of every lagged (replayed) row, per pass.
- A configuration's point is the mean over seeds of its costs; it counts only if it reached the
  target in every seed. A recipe's best point is its configuration with the fewest rollouts to the
  target (ties: fewer learner positions); comparisons between best points are paired by seed
  (geometric mean of the per-seed ratios, 95 % t-interval on their logarithms).
"""

from __future__ import annotations

import math
import statistics

GRID_EPOCHS = (1, 2, 4)
GRID_LR = (1, 2, 4)  # × the loop's default learning rate
EPOCHS_RANGE = (1, 8)  # what --grid-epochs accepts
LR_RANGE = (0.125, 16.0)  # what --grid-lr accepts (multiples of the default rate)
TARGET_SHARE = 0.97  # the second target: this share of the best tuned grpo's own final pass@1
# the cumulative costs of a run's curve, measured to each target
COSTS = ("rollouts", "token_passes", "learner_positions", "generated_tokens", "seconds", "generate_seconds",
         "curate_seconds", "train_seconds")


def parse_spec(text: str, default_lr: float, named: dict[str, tuple[str, dict]]) -> dict:
    """`recipe[@μ][,lr=X|lr=Nx][,param=value...]` → {name, base, recipe, sets, epochs, lr}."""
    head, *rest = text.split(",")
    base, _, mu = head.partition("@")
    recipe, sets = named.get(base, (base, {}))
    sets = dict(sets)
    lr = default_lr
    for item in rest:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{text!r}: expected name=value after a comma, got {item!r}")
        if key == "lr":
            lr = default_lr * float(value[:-1]) if value.endswith("x") else float(value)
        else:
            sets[key] = value
    epochs = int(mu) if mu else 1
    if epochs < 1 or not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"{text!r}: μ must be ≥ 1 and lr > 0")
    plain = not mu and len(rest) == 0
    name = base if plain else f"{base}@{epochs},lr={lr:g}" + "".join(f",{i}" for i in rest if not i.startswith("lr="))
    return {"name": name, "base": base, "recipe": recipe, "sets": sets, "epochs": epochs, "lr": lr}


def grid(bases: list[str], default_lr: float, epochs=GRID_EPOCHS, lrs=GRID_LR) -> list[str]:
    """Every recipe of `bases` at every μ × learning-rate multiple (specs for `parse_spec`)."""
    return [f"{b}@{m},lr={default_lr * k:g}" for b in bases for m in epochs for k in lrs
            if not (b == "grpo" and m == 1 and k == 1)]  # that one is the reference, run as `grpo`


def is_reference(run: dict, default_lr: float) -> bool:
    return (run["recipe"] == "grpo" and run.get("epochs", 1) == 1 and not run["sets"]
            and math.isclose(run["lr"], default_lr))


def cost_to(curve: list[dict], target: float, key: str, metric: str = "pass@1") -> float | None:
    """`key` (a cumulative cost) when `metric` first reaches `target`, linear between evaluations."""
    prev = None
    for point in curve:
        if point[metric] >= target:
            if prev is None or point[metric] == prev[metric]:
                return float(point[key])
            frac = (target - prev[metric]) / (point[metric] - prev[metric])
            return prev[key] + frac * (point[key] - prev[key])
        prev = point
    return None


def targets(runs: list[dict], default_lr: float) -> dict[tuple[str, int], float]:
    """(split, seed) → the final pass@1 of grpo@1 at the default rate (the `grpo1` target)."""
    return {(r["split"], r["seed"]): r["curve"][-1]["pass@1"] for r in runs if is_reference(r, default_lr)}


def share_targets(pts: dict[tuple[str, str], dict], share: float = TARGET_SHARE) -> dict[tuple[str, int], float]:
    """(split, seed) → `share` × the final pass@1 of grpo's best point in `pts` (the `97` target)."""
    out = {}
    for split in sorted({sp for sp, _ in pts}):
        top = best(pts, split, "grpo")
        if top:
            out.update({(split, seed): share * c["final"] for seed, c in top[1]["seeds"].items()})
    return out


def value_at(curve: list[dict], x: float, key: str = "rollouts", metric: str = "pass@1") -> float:
    """`metric` at cumulative cost `x`, linear between evaluations (the last value beyond the curve)."""
    prev = None
    for point in curve:
        if point[key] >= x:
            if prev is None or point[key] == prev[key]:
                return float(point[metric])
            frac = (x - prev[key]) / (point[key] - prev[key])
            return prev[metric] + frac * (point[metric] - prev[metric])
        prev = point
    return float(curve[-1][metric])


def points(runs: list[dict], default_lr: float, tg: dict[tuple[str, int], float] | None = None
           ) -> dict[tuple[str, str], dict]:
    """(split, configuration) → its per-seed costs to the target and summary; `tg`: the targets
    ((split, seed) → pass@1), by default `targets` (grpo@1's finals)."""
    tg = targets(runs, default_lr) if tg is None else tg
    budget = {(r["split"], r["seed"]): r["rollouts"] for r in runs if is_reference(r, default_lr)}
    out: dict[tuple[str, str], dict] = {}
    for r in runs:
        t = tg.get((r["split"], r["seed"]))
        if t is None:
            continue
        p = out.setdefault((r["split"], r["name"]), {"base": r["name"].split("@")[0], "epochs": r.get("epochs", 1),
                                                     "lr": r["lr"], "seeds": {}})
        costs = {key: cost_to(r["curve"], t, key) if key in r["curve"][-1] else None for key in COSTS}
        b = budget.get((r["split"], r["seed"]))
        p["seeds"][r["seed"]] = {
            **costs, "final": r["curve"][-1]["pass@1"],
            "at_budget": value_at(r["curve"], b) if b else None,  # pass@1 at grpo@1's rollouts
            "all_rollouts": r["rollouts"], "all_token_passes": r["token_passes"],
            "all_positions": r.get("learner_positions"),
        }
    for p in out.values():
        seeds = p["seeds"].values()
        p["reached"] = sum(1 for c in seeds if c["rollouts"] is not None)
        p["complete"] = p["reached"] == len(p["seeds"])
        for key in COSTS:
            vals = [c[key] for c in seeds if c[key] is not None]
            p[key] = statistics.mean(vals) if p["complete"] and len(vals) == len(p["seeds"]) else None
        p["final"] = statistics.mean(c["final"] for c in seeds)
        at = [c["at_budget"] for c in seeds if c["at_budget"] is not None]
        p["at_budget"] = statistics.mean(at) if at else None
    return out


def best(pts: dict[tuple[str, str], dict], split: str, base: str) -> tuple[str, dict] | None:
    """The configuration of `base` with the fewest rollouts to the target on `split` (all seeds reached)."""
    mine = [(name, p) for (sp, name), p in pts.items() if sp == split and p["base"] == base and p["complete"]]
    return min(mine, key=lambda x: (x[1]["rollouts"], x[1]["learner_positions"] or 0, x[1]["token_passes"]),
               default=None)


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def paired_diff(a: dict, b: dict, key: str = "final") -> tuple[float, float, float, int] | None:
    """Mean over common seeds of a's `key` − b's, with a 95 % t-interval; and the seed count."""
    diffs = [a["seeds"][s][key] - b["seeds"][s][key] for s in sorted(set(a["seeds"]) & set(b["seeds"]))
             if a["seeds"][s][key] is not None and b["seeds"][s][key] is not None]
    if not diffs:
        return None
    m = statistics.mean(diffs)
    half = T95.get(len(diffs) - 1, 1.96) * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return m, m - half, m + half, len(diffs)


def fmt_diff(r) -> str:
    return "–" if r is None else f"{r[0]:+.3f} [{r[1]:+.3f}, {r[2]:+.3f}] ({r[3]} seeds)"


def paired_ratio(a: dict, b: dict, key: str) -> tuple[float, float, float, int] | None:
    """Geometric mean over common seeds of a's cost / b's, with a 95 % t-interval; and the seed count."""
    logs = [math.log(max(a["seeds"][s][key], 1.0) / max(b["seeds"][s][key], 1.0))
            for s in sorted(set(a["seeds"]) & set(b["seeds"]))
            if a["seeds"][s][key] is not None and b["seeds"][s][key] is not None]
    if not logs:
        return None
    m = statistics.mean(logs)
    half = T95.get(len(logs) - 1, 1.96) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return math.exp(m), math.exp(m - half), math.exp(m + half), len(logs)


def fmt_ratio(r) -> str:
    return "–" if r is None else f"{r[0]:.2f}× [{r[1]:.2f}, {r[2]:.2f}] ({r[3]} seeds)"


def _n(x, fmt: str = ",.0f") -> str:
    return "–" if x is None else format(x, fmt)


def _split_seconds(p: dict) -> str:
    if p["seconds"] is None:
        return "–"
    parts = [p[k] for k in ("generate_seconds", "curate_seconds", "train_seconds")]
    return f"{p['seconds']:.1f}" + ("" if None in parts else " ({:.1f} / {:.1f} / {:.1f})".format(*parts))


def table_rows(pts: dict, split: str, pts97: dict | None = None) -> list[list[str]]:
    """One row per configuration: its costs to both targets (`pts`: grpo1, `pts97`: 97 %)."""
    rows = []
    for (sp, name), p in sorted(pts.items(), key=lambda x: (x[1]["base"], x[1]["epochs"], x[1]["lr"])):
        if sp != split:
            continue
        q = (pts97 or {}).get((sp, name))
        row = [name, f"{p['reached']}/{len(p['seeds'])}", _n(p["rollouts"]), _n(p["learner_positions"]),
               _n(p["token_passes"]), _split_seconds(p)]
        if pts97 is not None:
            row += ["–", "–", "–", "–"] if q is None else [
                f"{q['reached']}/{len(q['seeds'])}", _n(q["rollouts"]), _n(q["learner_positions"]), _split_seconds(q)]
        row += [f"{p['final']:.3f}", _n(p["at_budget"], ".3f")]
        rows.append(row)
    return rows


TABLE_HEADER = ["configuration", "reached grpo@1's final", "rollouts to it", "learner positions to it",
                "token-passes to it", "loop s to it (generate / curate / train)",
                "reached 97 % of best grpo", "rollouts to it", "learner positions to it",
                "loop s to it (generate / curate / train)", "final pass@1 (mean)", "pass@1 at grpo@1's rollouts"]


def best_rows(pts: dict, pts97: dict, split: str) -> list[list[str]]:
    """Each recipe's best point (fewest rollouts to grpo@1's final) against the best tuned grpo's,
    paired by seed: ratios of its costs to both targets and the difference of final pass@1."""
    ref = best(pts, split, "grpo")
    rows = []
    for base in sorted({p["base"] for (sp, _), p in pts.items() if sp == split}):
        top = best(pts, split, base)
        if not top:
            rows.append([base, "no configuration reached the target in every seed"] + ["–"] * 8)
            continue
        name, p = top
        q = pts97.get((split, name))
        rref = ref and pts97.get((split, ref[0]))
        row = [base, name, f"{p['final']:.3f}", fmt_diff(paired_diff(p, ref[1], "final")) if ref else "–",
               fmt_diff(paired_diff(p, ref[1], "at_budget")) if ref else "–"]
        for key in ("rollouts", "learner_positions", "seconds"):
            row.append(fmt_ratio(paired_ratio(p, ref[1], key)) if ref else "–")
        for key in ("rollouts", "learner_positions"):
            row.append(fmt_ratio(paired_ratio(q, rref, key)) if q and rref else "–")
        rows.append(row)
    return rows


BEST_HEADER = ["recipe", "best point", "final pass@1", "final − best grpo (paired)",
               "pass@1 at grpo@1's rollouts − best grpo (paired)",
               "rollouts to grpo@1's final vs best grpo", "learner positions to it vs best grpo",
               "loop s to it vs best grpo", "rollouts to 97 % vs best grpo", "learner positions to 97 % vs best grpo"]

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")


def pareto_svg(panels: list[tuple[str, str, dict]], path: str, x_key: str = "learner_positions") -> None:
    """Rollouts to a target against learner positions to it (`x_key`), one point per configuration
    that reached it in every seed; a panel per (split, target label, points); each recipe's best
    point ringed, the front (fewest rollouts for at most these positions) joined."""
    from xml.sax.saxutils import escape

    w, h, pad = 460, 330, 56
    bases = sorted({p["base"] for _, _, pts in panels for p in pts.values()})
    colour = {b: COLOURS[i % len(COLOURS)] for i, b in enumerate(bases)}
    x_label = {"learner_positions": "learner positions", "token_passes": "learner token-passes"}.get(x_key, x_key)
    out = []
    for i, (split, label, pts) in enumerate(panels):
        mine = [(n, p) for (sp, n), p in pts.items() if sp == split and p["complete"] and p[x_key] is not None]
        g = [f'<g transform="translate({i * w},0)"><text x="{pad}" y="18" class="ct">{escape(split)}: cost to '
             f"{escape(label)} (mean over seeds)</text>"]
        if mine:
            xs = [p[x_key] for _, p in mine]
            ys = [p["rollouts"] for _, p in mine]
            x0, x1 = 0.0, max(xs) * 1.08
            y0, y1 = 0.0, max(ys) * 1.08

            def sx(x):
                return pad + (x - x0) / (x1 - x0 or 1) * (w - pad - 16)

            def sy(y):
                return h - pad + 10 - (y - y0) / (y1 - y0 or 1) * (h - pad - 30)

            g.append(f'<line class="axis" x1="{pad}" y1="{h - pad + 10}" x2="{w - 16}" y2="{h - pad + 10}"/>'
                     f'<line class="axis" x1="{pad}" y1="30" x2="{pad}" y2="{h - pad + 10}"/>')
            for k in range(5):
                xv, yv = x0 + (x1 - x0) * k / 4, y0 + (y1 - y0) * k / 4
                g.append(f'<text class="tick" x="{sx(xv):.1f}" y="{h - pad + 24}" text-anchor="middle">{xv / 1000:.0f}k</text>'
                         f'<text class="tick" x="{pad - 4}" y="{sy(yv) + 3:.1f}" text-anchor="end">{yv / 1000:.1f}k</text>')
            g.append(f'<text class="al" x="{(pad + w) / 2:.0f}" y="{h - 8}" text-anchor="middle">{x_label} to '
                     f'target</text><text class="al" transform="translate(12,{h / 2:.0f}) rotate(-90)" '
                     f'text-anchor="middle">rollouts generated to target</text>')
            front = sorted(mine, key=lambda x: (x[1][x_key], x[1]["rollouts"]))
            line, best_y = [], math.inf
            for _, p in front:
                if p["rollouts"] < best_y:
                    best_y = p["rollouts"]
                    line.append(f"{sx(p[x_key]):.1f},{sy(p['rollouts']):.1f}")
            g.append(f'<polyline fill="none" stroke="#999" stroke-dasharray="4 3" points="{" ".join(line)}"/>')
            for n, p in mine:
                g.append(f'<circle cx="{sx(p[x_key]):.1f}" cy="{sy(p["rollouts"]):.1f}" r="3.5" '
                         f'fill="{colour[p["base"]]}"><title>{escape(n)}</title></circle>')
            for b in bases:
                top = best(pts, split, b)
                if top and top[1][x_key] is not None:
                    p = top[1]
                    g.append(f'<circle cx="{sx(p[x_key]):.1f}" cy="{sy(p["rollouts"]):.1f}" r="7" fill="none" '
                             f'stroke="{colour[b]}" stroke-width="1.5"><title>best {escape(top[0])}</title></circle>')
        else:
            g.append(f'<text x="{pad}" y="60" class="al">no configuration reached the target in every seed</text>')
        g.append("</g>")
        out.append("".join(g))
    legend = "".join(f'<g transform="translate({16 + 150 * k},{h + 6})"><circle cx="5" cy="5" r="4" fill="{colour[b]}"/>'
                     f'<text x="14" y="9" class="lg">{escape(b)}</text></g>' for k, b in enumerate(bases))
    style = ("<style>svg{font-family:sans-serif}.ct{font-size:12px;font-weight:600}.tick{font-size:10px;fill:#555}"
             ".al{font-size:11px;fill:#555}.lg{font-size:11px}.axis{stroke:#8a949e}</style>")
    with open(path, "w") as fh:
        fh.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * max(1, len(panels))}" height="{h + 26}">'
                 f"{style}{''.join(out)}{legend}</svg>\n")
