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
    assert sorted(r["name"] for r in runs) == ["d3s", "grpo"]
    for r in runs:
        assert [p["iteration"] for p in r["curve"]] == [0, 1, 2]
        assert all(0 <= p["pass@1"] <= p["pass@2"] <= 1 for p in r["curve"])
        assert r["curve"][-1]["learner_tokens"] == r["learner_tokens"] > 0
    svg = (out / "learning-harder.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") >= 4  # 2 recipes × 2 charts
    rows, _ = learning.summarise(runs)
    assert [r[0] for r in rows] == ["grpo", "d3s"] and len(rows[0]) == len(learning.HEADER)
