"""Several runs in one buffer (docs/choices.md §Runs): each run's rows are aged against its own
newest version, the loop and `rollstore curate` stop with one line when every candidate is refused,
the report draws per-version charts per run, and `rollstore compare` puts two runs side by side."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rollstore.loop.driver import LoopConfig, run_loop
from rollstore.loop.view import settings_line
from rollstore.queries.session import Session
from rollstore.storage.buffer import Buffer


def _loop(root, recipe: str, run_id: str, **kw) -> dict:
    cfg = LoopConfig(buffer=str(root), recipe=recipe, run_id=run_id, iterations=2, prompts_per_iter=8,
                     eval_every=1, eval_prompts=20, **kw)
    return run_loop(dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, group_size=4)))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """grpo then greso in one buffer; greso with max_policy_lag 0, which marked every fresh row
    stale when it was aged against grpo's versions."""
    root = tmp_path_factory.mktemp("runs") / "buf"
    Buffer.init(str(root)).close()
    _loop(root, "grpo", "first")
    _loop(root, "greso", "second", max_policy_lag=0, pool_size=16)
    return str(root)


def _sql(root: str, query: str) -> list[tuple]:
    with Buffer.open(root) as buf, buf.snapshot() as snap, Session(snap) as s:
        return s.execute(query).fetchall()


def test_a_second_run_is_aged_against_its_own_versions(two_runs):
    rows = _sql(two_runs, "SELECT r.run_id, r.step, s.reason, min(s.age), max(s.age), count(*) "
                          "FROM selections s JOIN rollouts r USING (rollout_id) GROUP BY ALL ORDER BY 1, 2")
    assert {(run, step) for run, step, *_ in rows} == {("first", 0), ("first", 1), ("second", 0), ("second", 1)}
    for run, step, reason, lo, hi, n in rows:
        assert (reason, lo, hi) == ("selected", 0, 0), (run, step, reason, lo, hi)
    # the second run's first step was sampled by the base weights (v0), after the first run published v1, v2
    versions = dict(_sql(two_runs, "SELECT run_id || step, policy_version FROM rollouts GROUP BY ALL"))
    assert versions["second0"] == 0 and versions["first1"] == 1 and versions["second1"] > versions["first1"]
    params = [json.loads(p) for (p,) in _sql(two_runs, "SELECT params FROM curations ORDER BY created_at")]
    assert [p["current_version"] for p in params] == [0, 1, 0, versions["second1"]]


def test_the_report_draws_each_run_against_its_own_versions(two_runs):
    rows = _sql(two_runs, "SELECT run_id, list(run_version ORDER BY policy_version) FROM run_versions GROUP BY ALL "
                          "ORDER BY 1")
    assert rows == [("first", [0, 1, 2]), ("second", [0, 1, 2])]
    from rollstore.queries import load_sql

    by_version = _sql(two_runs, load_sql("report_accuracy_by_version"))
    assert {(r[0], r[2]) for r in by_version} == {("first", 0), ("first", 1), ("second", 0), ("second", 1)}


def test_compare_puts_two_runs_side_by_side(two_runs, cli):
    import rollstore as rs

    cmp = rs.open(two_runs).compare_runs("first", "second")
    assert [r["run_id"] for r in cmp.runs] == ["first", "second"]
    assert [r["rollouts"] for r in cmp.runs] == [64, 64]
    assert cmp.runs[0]["optimiser_steps"] == 4 * cmp.runs[1]["optimiser_steps"]  # grpo's μ 4 against greso's 1
    assert cmp.differ["epochs"] == (4, 1) and cmp.differ["lr"] == (2e-4, 5e-5)
    assert cmp.differ["recipe"] == ("grpo", "greso") and cmp.differ["pool_size"] == (2048, 16)
    assert cmp.differ["max_policy_lag"] == (None, 0) and "recipe.prompt_skip" in cmp.differ
    assert {r["run_version"] for r in cmp.heldout} == {0, 1, 2}
    assert {r["phase"] for r in cmp.phases} >= {"generation", "curation", "optimiser"}
    res = cli("compare", two_runs, "first", "second")
    assert res.code == 0 and res.stdout == cmp.text() + "\n"
    for line in ("rollouts generated", "learner tokens", "held-out greedy_accuracy (heldout)",
                 "loop seconds by phase", "settings that differ"):
        assert line in res.stdout


@pytest.mark.parametrize("a, b, needle", [("first", "first", "named twice"),
                                          ("first", "secnd", "no run 'secnd'"),
                                          ("nope", "second", "no run 'nope'")])
def test_compare_refuses_one_run_or_unknown_runs(two_runs, cli, a, b, needle):
    res = cli("compare", two_runs, a, b)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.code == 1 and len(lines) == 1 and needle in lines[0] and not res.stdout, res.stderr
    if b == "secnd":
        assert "did you mean 'second'" in lines[0]


def test_every_candidate_refused_stops_the_curation_and_the_loop(two_runs, cli, tmp_path):
    res = cli("curate", two_runs, "--recipe", "grpo", "--set", "max_policy_lag=0", "--set", "current_version=9")
    assert res.code == 1 and "batch         where run_id = 'second' AND step = 1" in res.stdout
    assert "every one of 32 candidates was refused before selection (stale 32" in res.stderr
    assert "current_version 9" in res.stderr and "nothing to train" in res.stderr
    root = str(tmp_path / "b")
    res = cli("loop", root, "--recipe", "grpo", "-k", "2", "--prompts-per-iter", "8", "--group-size", "4",
              "--eval-every", "0", "--max-policy-lag", "1", "--set", "current_version=50")
    assert res.code == 1 and "iteration 0" in res.stderr and "the loop stopped" in res.stderr, res.stderr
    assert _sql(root, "SELECT count(*) FROM checkpoints") == [(0,)]  # nothing published


def test_the_loop_shows_its_settings_and_warns_of_a_pool_greso_cannot_revisit():
    cfg = LoopConfig(buffer="unused", recipe="grpo", iterations=3, prompts_per_iter=16)
    line = settings_line(cfg)
    assert "recipe grpo" in line and "μ 4 (recipe)" in line and "lr 0.0002 (recipe)" in line
    assert "pool 2048 prompts" in line and "16 prompts × 8" in line
    assert cfg.warnings() == []
    greso = LoopConfig(buffer="unused", recipe="greso", iterations=16, prompts_per_iter=128)
    assert "μ 1 (default)" in settings_line(greso)
    (warning,) = greso.warnings()
    assert "pool of 2048 prompts" in warning and "no prompt comes back" in warning
    assert LoopConfig(buffer="unused", recipe="greso", iterations=17, prompts_per_iter=128).warnings() == []


def test_recipes_explain_shows_the_training_settings(cli):
    res = cli("recipes", "--explain", "grpo")
    assert res.code == 0 and "training (rollstore loop): epochs μ 4 (the recipe's), lr 0.0002 (the recipe's)" in res.stdout
    res = cli("recipes", "greso")  # the help's `rollstore recipes NAME` works too
    assert res.code == 0 and "epochs μ 1 (the loop's default), lr 5e-05 (the loop's default)" in res.stdout
    line = [x for x in cli("recipes", "d3x").stderr.splitlines() if x.strip()]
    assert len(line) == 1 and "did you mean 'd3s'" in line[0]


def test_audit_compare_lists_how_each_curation_was_trained(two_runs, cli):
    ids = [c for (c,) in _sql(two_runs, "SELECT curation_id FROM curations ORDER BY created_at")]
    res = cli("audit", two_runs, ids[0], "--compare", ids[2], "--format", "json")
    assert res.code == 0
    doc = json.loads(res.stdout)
    params = {r["parameter"]: (r["a"], r["b"]) for r in doc["params"] + doc["training"]}
    assert params["training.epochs"] == ("4", "1") and params["training.lr"] == ("0.0002", "5e-05")
    assert params["training.run_id"] == ("first", "second") and params["training.optimiser_steps"] == ("4", "1")
    assert params["prompt_skip"] == ("none", "greso")
    text = cli("audit", two_runs, ids[0], "--compare", ids[2]).stdout
    assert "no candidate in common" in text and "rollstore compare" in text and "a_only" not in text


def test_the_report_page_splits_runs_and_cards_show_the_gold_answer(two_runs, tmp_path):
    import re

    from rollstore.report.page import build_report

    out = str(tmp_path / "r.html")
    with Buffer.open(two_runs) as buf:
        build_report(buf, out)
    html = open(out, encoding="utf-8").read()
    assert "Accuracy by version of each run" in html and 'data-series="first sampled"' in html
    assert 'data-series="second sampled"' in html and 'data-series="second heldout greedy_accuracy"' in html
    cards = re.findall(r'<div class="card".*?</div></div>', html, re.S)
    assert cards and all("gold answer <code>" in c for c in cards)


@pytest.mark.parametrize("kwargs, needle", [
    ({"a": None, "b": "second"}, "run_a: None is not a run id"), ({"a": "first", "b": 3}, "run_b: 3 is not a run id"),
    ({"a": "first", "b": ""}, "run_b: '' is not"), ({"a": "first", "b": "second", "snapshot": 1.5}, "snapshot: 1.5"),
    ({"a": "first", "b": "second", "snapshot": True}, "snapshot: True"),
    ({"a": "first", "b": "second", "snapshot": -1}, "snapshot: -1"),
    ({"a": "first", "b": "second", "snapshot": 10**30}, "no snapshot"),
])
def test_compare_runs_refuses_hostile_values_with_one_line(two_runs, kwargs, needle):
    import rollstore as rs

    with pytest.raises(rs.RollstoreError, match=needle) as exc:
        rs.open(two_runs).compare_runs(**kwargs)
    assert "\n" not in str(exc.value)


def test_why_refuses_what_is_not_an_id(two_runs):
    import rollstore as rs

    cur = rs.open(two_runs).curation()
    for bad in (None, 3, b"x"):
        with pytest.raises(rs.RollstoreError, match="is not a string"):
            cur.why(bad)
