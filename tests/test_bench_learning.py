"""`bench/learning.py --quick`: the recipe comparison runs end to end through the real loop and
writes its JSON curves and SVG plot (tiny sizes; the numbers themselves are not asserted)."""

from __future__ import annotations

import json

import pytest

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
    for r in runs:  # learner positions and the loop's seconds split, cumulative like every cost
        last = r["curve"][-1]
        assert last["learner_positions"] == r["learner_positions"] > 0
        parts = [last[k] for k in learning.SECONDS_PARTS]
        assert all(x > 0 for x in parts) and sum(parts) <= last["seconds"]
    assert "<polyline" in (out / "pareto.svg").read_text()
    # --reuse takes every finished run from its folder (its bench-run.json; without one, rebuilt from
    # its buffer): the same results, nothing run again
    (tmp_path / "runs" / "harder-dapo-s0" / learning.RUN_FILE).unlink()
    assert learning.main(["--quick", "--splits", "harder", "--jobs", "1", "--model", default_tiny, "--reuse",
                          "--out", str(tmp_path / "again"), "--root", str(tmp_path / "runs")]) == 0
    again = {a["name"]: a for a in json.loads((tmp_path / "again" / "learning-harder.json").read_text())}
    assert again["grpo"].get("reused") and again["grpo"]["curve"] == grpo["curve"]
    assert again["dapo"].get("rebuilt")
    for key in ("pass@1", "rollouts", "learner_tokens", "token_passes", "learner_positions"):
        assert [p[key] for p in again["dapo"]["curve"]] == [p[key] for p in dapo["curve"]], key


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
    from rollstore.loop.driver import PHASES

    assert loop_profile.main(["--iterations", "2", "--no-record"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split("|")[1].strip() for ln in out.splitlines() if ln.startswith("|")][2:]
    assert rows == list(PHASES) + ["(between laps)", "iteration"]
    assert "Everything except generation and the optimiser steps:" in out


def _refused(capsys, argv: list[str], *words: str) -> None:
    """`bench.learning` refuses `argv` with one line naming `words`, before anything runs."""
    with pytest.raises(SystemExit) as exc:
        learning.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bench.learning: "), err
    for w in words:
        assert w in err, (w, err)


def test_bad_input_is_one_line_and_runs_nothing(tmp_path, capsys, monkeypatch):
    root, out = tmp_path / "runs", tmp_path / "out"
    common = ["--root", str(root), "--out", str(out), "--no-record"]
    _refused(capsys, ["--splits", "nosuch", *common], "'nosuch'", "carries")
    _refused(capsys, ["--recipes", "grpo", "bogus@2", *common], "'bogus'")
    _refused(capsys, ["--grid", "d3s", "bogus", *common], "'bogus'")
    _refused(capsys, ["--grid", "d3s", "--grid-lr", "1", "100", *common], "--grid-lr 100")
    _refused(capsys, ["--grid", "d3s", "--grid-epochs", "0", *common], "--grid-epochs 0")
    _refused(capsys, ["--part", "3/2", *common], "--part")
    _refused(capsys, ["--max-new-tokens", "train=0", *common], "--max-new-tokens")
    _refused(capsys, ["--best", str(tmp_path / "nogrid"), *common], "learning-train.json")
    monkeypatch.setitem(learning.SPLITS, "made-up", ("builtin:nosuch-task", "heldout", "builtin:tiny"))
    _refused(capsys, ["--splits", "made-up", *common], "'made-up'", "builtin:nosuch-task")
    assert not root.exists() and not out.exists()  # nothing run, nothing written


def test_a_root_holds_the_runs_of_one_configuration(tmp_path, capsys):
    """A --reuse folder written by another configuration is refused (one line naming the folder and
    what differs); so is a folder of runs without a fingerprint. Fast: nothing trains."""
    from rollstore.loop import LoopConfig

    root = tmp_path / "runs"
    args = learning._parser().parse_args(["--iterations", "12"])
    fp = learning.fingerprint(args, 1e-4, LoopConfig(buffer=""), ["train"], {})
    learning.claim_root(str(root), fp)
    assert json.loads((root / learning.CONFIG_FILE).read_text()) == json.loads(json.dumps(fp))
    learning.claim_root(str(root), fp)  # the same configuration: accepted
    _refused(capsys, ["--reuse", "--root", str(root), "--iterations", "24", "--lr", "1e-4", "--no-record",
                      "--out", str(tmp_path / "out")], str(root), "iterations 12 there, 24 here")
    _refused(capsys, ["--reuse", "--root", str(root), "--iterations", "12", "--lr", "1e-4", "--no-record",
                      "--max-new-tokens", "train=40", "--out", str(tmp_path / "out")], "split train")
    bare = tmp_path / "bare"
    (bare / "train-grpo-s0").mkdir(parents=True)
    _refused(capsys, ["--reuse", "--root", str(bare), "--no-record", "--out", str(tmp_path / "out")],
             str(bare), learning.CONFIG_FILE)
    assert sorted(p.name for p in root.iterdir()) == [learning.CONFIG_FILE]


def _grid_runs() -> list[dict]:
    """Two seeds of three configurations with hand-made curves (evaluations every 100 rollouts)."""

    def run(name, seed, finals, lr=1e-4, epochs=1):
        curve = [{"iteration": i, "pass@1": f, "rollouts": 100 * i, "learner_positions": 1000 * i * epochs,
                  "token_passes": 10 * i, "seconds": float(i)} for i, f in enumerate(finals)]
        return {"name": name, "recipe": name.split("@")[0], "sets": {}, "seed": seed, "split": "train", "lr": lr,
                "epochs": epochs, "curve": curve, "rollouts": curve[-1]["rollouts"], "token_passes": 0}

    runs = [run("grpo", s, [0.1, 0.2, 0.3]) for s in (0, 1)]
    runs += [run("grpo@2,lr=0.0002", s, [0.1, 0.3, 0.5], 2e-4, 2) for s in (0, 1)]
    return runs + [run("d3s@1,lr=0.0002", s, [0.1, 0.4, 0.45], 2e-4) for s in (0, 1)]


def test_split_budgets_and_targets():
    assert learning.max_new_tokens("train") == learning.DEFAULT_MAX_NEW_TOKENS == 8
    assert learning.max_new_tokens("train", {"train": 40}) == 40
    from bench import tuned

    runs = _grid_runs()
    pts = tuned.points(runs, 1e-4)
    assert tuned.best(pts, "train", "grpo")[0] == "grpo@2,lr=0.0002"  # reaches 0.3 at 100 rollouts, grpo at 200
    t97 = tuned.share_targets(pts)
    assert t97 == {("train", 0): pytest.approx(0.485), ("train", 1): pytest.approx(0.485)}
    pts97 = tuned.points(runs, 1e-4, t97)
    assert pts97[("train", "d3s@1,lr=0.0002")]["rollouts"] is None  # d3s never reaches 97 % of 0.5
    assert pts97[("train", "grpo@2,lr=0.0002")]["rollouts"] == pytest.approx(192.5)
    assert pts[("train", "d3s@1,lr=0.0002")]["learner_positions"] == pytest.approx(666.67, rel=1e-4)
    rows = tuned.best_rows(pts, pts97, "train")
    assert [r[0] for r in rows] == ["d3s", "grpo"] and all(len(r) == len(tuned.BEST_HEADER) for r in rows)
    assert rows[0][5].startswith("0.67×")  # d3s: 66.7 rollouts to 0.3 against grpo@2's 100
    assert rows[0][6].startswith("0.33×")  # learner positions: 667 against grpo@2's 2,000 (μ 2)


def test_best_points_of_a_grid_are_what_best_runs(tmp_path):
    (tmp_path / "learning-train.json").write_text(json.dumps(_grid_runs()))
    assert learning.best_specs(str(tmp_path), ["train"], 1e-4, "grpo1") == {
        "train": ["grpo", "grpo@2,lr=0.0002", "d3s@1,lr=0.0002"]}
    # to 97 % of the best grpo's final only grpo@2 gets: d3s has no best point there
    assert learning.best_specs(str(tmp_path), ["train"], 1e-4, "97") == {"train": ["grpo", "grpo@2,lr=0.0002"]}


def test_a_run_folder_is_run_by_one_process_at_a_time(tmp_path):
    """A second claim on a run folder (a killed driver's worker still running it) is refused in one
    line; once the first holder lets go, it is granted."""
    import multiprocessing

    from bench.learning import BenchError, claim_run_folder

    root = str(tmp_path / "runs" / "chains-d3s@4-s0")
    first = claim_run_folder(root)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:  # another process, as a pool worker is
        refused = pool.apply(_claim_message, (root,))
    assert refused is not None and "another process is running this configuration" in refused
    first.close()
    with ctx.Pool(1) as pool:
        assert pool.apply(_claim_message, (root,)) is None
    with pytest.raises(BenchError):  # (flock is per open file: a second open in this process is refused too)
        with claim_run_folder(root):
            claim_run_folder(root)


def _claim_message(root: str):
    from bench.learning import BenchError, claim_run_folder

    try:
        claim_run_folder(root).close()
    except BenchError as exc:
        return str(exc)
    return None


def test_a_locked_run_folder_ends_the_bench_in_one_line(tmp_path, capsys):
    """Through the real call path: a run whose folder another process holds ends `bench.learning` with
    one `error:` line and exit status 2 (no worker traceback)."""
    from bench.learning import claim_run_folder

    root = tmp_path / "runs"
    args = ["--quick", "--splits", "train", "--recipes", "grpo", "--seeds", "1", "--jobs", "1", "--no-record",
            "--root", str(root), "--out", str(tmp_path / "out")]
    held = claim_run_folder(str(root / "train-grpo-s0"))
    try:
        with pytest.raises(SystemExit) as stop:
            learning.main(args)
    finally:
        held.close()
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "another process is running this configuration" in err[-1]
    assert "Traceback" not in "\n".join(err)
