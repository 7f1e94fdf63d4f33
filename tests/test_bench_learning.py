"""`bench/learning.py --quick`: the recipe comparison runs end to end through the real loop and
writes its JSON curves and SVG plot (tiny sizes; the numbers themselves are not asserted)."""

from __future__ import annotations

import json

from bench import learning
from rollout_helpers import default_tiny, tiny_cache  # noqa: F401  (fixtures)


def test_quick_learning_bench(tmp_path, default_tiny):  # noqa: F811
    out = tmp_path / "out"
    assert learning.main(["--quick", "--splits", "harder", "--jobs", "1", "--model", default_tiny,
                          "--out", str(out), "--root", str(tmp_path / "runs")]) == 0
    runs = json.loads((out / "learning-harder.json").read_text())
    assert sorted(r["name"] for r in runs) == ["dapo", "grpo"]
    for r in runs:
        assert [p["iteration"] for p in r["curve"]] == [0, 1, 2]
        assert all(0 <= p["pass@1"] <= p["pass@2"] <= 1 for p in r["curve"])
        assert r["curve"][-1]["learner_tokens"] == r["learner_tokens"] > 0
        assert r["curve"][-1]["rollouts"] == r["rollouts"] >= 2 * 8 * 4  # every generated rollout counts
    grpo, dapo = sorted(runs, key=lambda r: r["name"] != "grpo")
    assert grpo["rollouts"] == 2 * 8 * 4 and dapo["rollouts"] % (8 * 4) == 0  # dapo may over-generate
    svg = (out / "learning-harder.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") >= 4  # 2 recipes × 2 charts
    rows = learning.summarise(runs)
    assert [r[0] for r in rows] == ["grpo", "dapo"] and len(rows[0]) == len(learning.HEADER)


def test_rollouts_to_reach_and_the_paired_ratio():
    curve = [{"pass@1": 0.1, "rollouts": 0}, {"pass@1": 0.3, "rollouts": 100}, {"pass@1": 0.5, "rollouts": 200}]
    assert learning.rollouts_to_reach(curve, 0.1) == 0
    assert learning.rollouts_to_reach(curve, 0.4) == 150  # linear between evaluations
    assert learning.rollouts_to_reach(curve, 0.6) is None
    grpo = {s: {"seed": s, "curve": curve} for s in (0, 1)}  # grpo reaches its final 0.5 at 200
    fast = [{"seed": s, "curve": [dict(p, rollouts=p["rollouts"] // 2) for p in curve]} for s in (0, 1)]
    text, ratios = learning.ratio_to_grpo(fast, grpo)
    assert ratios == [0.5, 0.5] and text.startswith("0.50×")
    slow = [{"seed": 0, "curve": curve[:2]}, {"seed": 1, "curve": curve}]
    text, ratios = learning.ratio_to_grpo(slow, grpo)
    assert ratios == [1.0] and "not reached in 1/2 seeds" in text
    mean, low, high = learning.interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and abs(high - mean - 4.303 * 1.0 / 3 ** 0.5) < 1e-9 and low < mean


def test_loop_profile_tiles_the_iteration(default_tiny, capsys):  # noqa: F811
    """bench/loop_profile.py at 2 iterations: every phase has its row and the shares are printed."""
    from bench import loop_profile
    from rollstore.loop.run import PHASES

    assert loop_profile.main(["--iterations", "2", "--no-record"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split("|")[1].strip() for ln in out.splitlines() if ln.startswith("|")][2:]
    assert rows == list(PHASES) + ["(between laps)", "iteration"]
    assert "Everything except generation and the optimiser steps:" in out
