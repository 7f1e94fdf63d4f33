"""`rollstore compare RUN_A RUN_B` / `Buffer.compare_runs(a, b)`: two runs of one buffer side by side.

Invariants:
- Every number comes from one of `queries/compare_*.sql` over one snapshot; nothing is written.
- Held-out curves are drawn against each run's own versions (`run_version`, docs/choices.md §Runs).
- Settings are the loop's (`checkpoints.metrics.settings`) and the recipe parameters of the newest
  curation each run trained on; only the ones that differ are listed, with how many agree.
- Comparing a run with itself, or naming a run the buffer does not hold, is refused with one line
  (`CompareError`) before any other query runs.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field

from rollstore.queries import load_sql
from rollstore.queries.session import Session
from rollstore.storage.buffer import Buffer
from rollstore.storage.errors import RollstoreError

# Parameters that differ between any two curations of a loop (the step, the schedule, "now"): not settings.
PER_CURATION = frozenset({"where", "progress", "current_version"})
# Loop settings that name the run rather than set it.
NOT_SETTINGS = frozenset({"run_id", "sets", "epochs_from", "lr_from"})


class CompareError(RollstoreError):
    """A comparison that cannot be made: one line naming the run."""


@dataclass
class Comparison:
    """Two runs side by side: `runs` (what each generated and trained), `heldout` (per split,
    metric and version of the run), `phases` (seconds per loop phase), `differ` (setting ->
    (a's value, b's value)) and `same` (how many settings agree)."""

    a: str
    b: str
    snapshot: int
    runs: list[dict]
    heldout: list[dict]
    phases: list[dict]
    differ: dict[str, tuple] = field(default_factory=dict)
    same: int = 0

    def text(self) -> str:
        """The comparison as `rollstore compare` prints it."""
        a, b = self.a, self.b
        w = max(12, len(a), len(b)) + 2
        lines = [f"{a} vs {b} (snapshot {self.snapshot})", f"{'':<28}{a:>{w}}{b:>{w}}"]

        def row(label: str, x, y) -> None:
            lines.append(f"{label:<28}{_fmt(x):>{w}}{_fmt(y):>{w}}")

        ra, rb = self.runs
        for key, label in (("rollouts", "rollouts generated"), ("steps", "steps"), ("groups", "groups"),
                           ("response_tokens", "response tokens"), ("sampled_accuracy", "sampled accuracy"),
                           ("optimiser_steps", "optimiser steps"), ("learner_tokens", "learner tokens"),
                           ("learner_samples", "learner samples"), ("checkpoints", "checkpoints")):
            row(label, ra[key], rb[key])
        row("versions", _versions(ra), _versions(rb))
        curves: dict[tuple, dict] = {}
        for r in self.heldout:
            curves.setdefault((r["split"], r["metric"]), {}).setdefault(r["run_version"], {})[r["run_id"]] = r["value"]
        for (split, metric), points in curves.items():
            lines.append(f"held-out {metric} ({split}), by version of the run:")
            for version, values in sorted(points.items()):
                row(f"  version {version}", values.get(a), values.get(b))
        if not curves:
            lines.append("held-out: no evaluation of either run (rollstore loop --eval-every N records them)")
        seconds: dict[str, dict] = {}
        for r in self.phases:
            seconds.setdefault(r["phase"], {})[r["run_id"]] = r["seconds"]
        if seconds:
            lines.append("loop seconds by phase (summed over checkpoints, up to the optimiser):")
            def secs(x) -> str:
                return "-" if x is None else f"{x:.2f}"

            for phase, values in sorted(seconds.items(), key=lambda kv: -sum(kv[1].values())):
                row(f"  {phase}", secs(values.get(a)), secs(values.get(b)))
            row("  total", secs(sum(v.get(a, 0.0) for v in seconds.values())),
                secs(sum(v.get(b, 0.0) for v in seconds.values())))
        else:
            lines.append("loop seconds: neither run recorded its phases (runs of `rollstore loop` do)")
        lines.append(f"settings that differ ({len(self.differ)}; {self.same} the same):")
        for name, (x, y) in sorted(self.differ.items()):
            row(f"  {name}", x, y)
        return "\n".join(lines)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.0f}"
    if isinstance(x, (dict, list)):
        return json.dumps(x, sort_keys=True)
    return str(x)


def _versions(r: dict) -> str:
    return "-" if r["first_version"] is None else f"v{r['first_version']}–v{r['last_version']}"


def _settings(row: dict | None) -> dict:
    """One run's settings, flat: the loop's, then the recipe's parameters (`recipe.NAME`)."""
    if row is None:
        return {}
    out = {k: v for k, v in json.loads(row["settings"] or "{}").items() if k not in NOT_SETTINGS}
    if row["recipe"] is not None:
        out["recipe"] = row["recipe"]
        for k, v in json.loads(row["params"]).items():
            if k not in PER_CURATION:
                out[f"recipe.{k}"] = v
    return out


def compare_runs(buf: Buffer, a: str, b: str, snapshot: int | None = None) -> Comparison:
    """Runs `a` and `b` of `buf` side by side (see the module's invariants)."""
    for name, value in (("run_a", a), ("run_b", b)):
        if not isinstance(value, str) or not value or "\x00" in value:
            raise CompareError(f"compare: {name}: {value!r} is not a run id (a non-empty string)")
    if snapshot is not None and (isinstance(snapshot, bool) or not isinstance(snapshot, int) or snapshot < 0):
        raise CompareError(f"compare: snapshot: {snapshot!r} is not a snapshot number (an integer ≥ 0)")
    if a == b:
        raise CompareError(f"compare: {a!r} is named twice; name two different runs")
    with buf.snapshot(snapshot) as snap, Session(snap) as s:
        known = [r["run_id"] for r in s.table(load_sql("compare_known_runs")).to_pylist()]
        for name in (a, b):
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise CompareError(f"compare: no run {name!r} in {buf.root} (its runs: "
                                   f"{', '.join(known[:12]) or 'none'}{', …' if len(known) > 12 else ''}){hint}")
        values = {"a": a, "b": b}
        runs = s.table(load_sql("compare_runs"), values).to_pylist()
        heldout = s.table(load_sql("compare_heldout"), values).to_pylist()
        phases = s.table(load_sql("compare_phases"), values).to_pylist()
        settings = {r["run_id"]: r for r in s.table(load_sql("compare_settings"), values).to_pylist()}
        seq = snap.seq
    sa, sb = _settings(settings.get(a)), _settings(settings.get(b))
    differ = {k: (sa.get(k), sb.get(k)) for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k)}
    same = len([k for k in set(sa) & set(sb) if sa[k] == sb[k]])
    return Comparison(a, b, seq, runs, heldout, phases, differ, same)
