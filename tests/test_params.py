"""Parameters of a curation run: the parameter table (each defined once; the docs' table is generated
from it), presets, `--set` parsing, exact decimal budgets, schedules."""

from __future__ import annotations

import json
import os
from fractions import Fraction

import pytest

from conftest import ROOT
from rollstore.curate.params import (
    DEFAULTS, PARAMETERS, ParamError, budget, builtin_recipes, coerce, load_recipe, parameter_table, parse_sets,
    resolve, token_budget,
)

ALL = ["d1s", "d1s-c", "d2s", "d3s", "d3s-i", "da3po", "dapo", "entropy-top", "greso", "grpo", "pods",
       "replay-d3s", "replay-groups", "replay-rollouts", "replay-rollouts-x3", "replay-window"]


def test_builtin_recipes_are_the_spec_table():
    assert builtin_recipes() == ALL
    presets = {name: load_recipe(name).presets for name in ALL}
    assert presets["grpo"] == {}
    assert presets["dapo"] == {"filter": "dynamic"}
    assert presets["da3po"] == {"filter": "dynamic", "amplify": "da3po"}
    assert presets["pods"] == {"sample": "pods"}
    assert presets["d1s"] == {"sample": "in_group"}
    assert presets["d1s-c"] == {"sample": "cross_group"}
    assert presets["d2s"] == {"sample": "cross_group", "token": "abs_adv_entropy"}
    assert presets["d3s"] == {"sample": "cross_group", "token": "abs_adv_entropy", "schedule": "linear"}
    assert presets["d3s-i"] == {"sample": "in_group", "token": "abs_adv_entropy", "schedule": "linear"}
    assert presets["entropy-top"] == {"filter": "dynamic", "token": "entropy", "token_fraction": Fraction(1, 5)}
    replay = {"replay_window": 2, "replay_max_uses": 2}
    assert presets["replay-groups"] == {"filter": "dynamic", "replay": "groups", **replay}
    assert presets["replay-rollouts"] == {"replay": "rollouts", **replay}
    assert presets["replay-d3s"] == {**presets["d3s"], "replay": "rollouts", **replay}
    assert presets["replay-window"] == {"replay": "window", "replay_window": 1, "replay_max_uses": 2}
    assert presets["replay-rollouts-x3"] == {"replay": "rollouts", "replay_window": 3, "replay_max_uses": 3,
                                            "replay_count": 1024}
    assert presets["greso"] == {"prompt_skip": "greso", "skip_target": Fraction(1, 10)}
    assert all("replay" in name for name in ALL if load_recipe(name).presets.get("replay"))


@pytest.mark.parametrize("name, value, message", [
    ("replay_window", "0", "replay_window: must be ≥ 1"),
    ("replay_max_uses", "0", "replay_max_uses: must be ≥ 1"),
    ("replay_count", "-3", "replay_count: must be ≥ 1"),
    ("replay_decay", "0", "replay_decay: must be in (0, 1]"),
    ("replay", "sometimes", "replay: 'sometimes' is not one of none, groups, rollouts, window"),
])
def test_replay_parameters_out_of_range_are_one_line(name, value, message):
    with pytest.raises(ParamError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")) as info:
        resolve(load_recipe("replay-groups"), {name: value})
    assert "\n" not in str(info.value)


def test_exact_decimal_budgets():
    # Binary floating point gets these wrong; exact rationals do not.
    assert 0.07 * 100 != 7 and token_budget(100, Fraction("0.07")) == 7
    p = resolve(load_recipe("d3s"), {"progress": "0.7"})
    assert p.sample_fraction() == Fraction("0.25") + Fraction("0.75") * Fraction("0.7")  # 0.775 exactly
    assert budget(20, p.sample_fraction()) == 16  # round half up of 15.5
    assert budget(10, Fraction("0.25")) == 3  # 2.5 → 3
    assert budget(3, Fraction("0.1")) == 2  # at least 2
    assert budget(1, Fraction("0.1")) == 1  # at most the pool
    assert token_budget(0, Fraction("0.2")) == 0
    assert p.token_fraction() == Fraction("0.2") + Fraction("0.8") * Fraction("0.7")


@pytest.mark.parametrize("sets, needle", [
    ({"nope": "1"}, "unknown parameter"),
    ({"sample_fraction": "0"}, "(0, 1]"),
    ({"token_fraction": "1.01"}, "(0, 1]"),
    ({"progress": "-0.1"}, "[0, 1]"),
    ({"amplify_max": "0.5"}, "≥ 1"),
    ({"difficulty_window": "0"}, "≥ 1"),
    ({"difficulty_window": "1.5"}, "integer"),
    ({"max_reuse": "0"}, "≥ 1"),
    ({"std": "mad"}, "not one of"),
    ({"sample_fraction_start": "0.5"}, "linear schedule"),
    ({"amplify_tau": "abc"}, "decimal"),
])
def test_bad_parameters(sets, needle):
    with pytest.raises(ParamError, match=None) as exc:
        resolve(load_recipe("grpo"), sets)
    assert needle in str(exc.value)


def test_schedule_rule_counts_only_user_settings():
    # entropy-top's own token_fraction preset is not a setting; switching it to linear is fine.
    p = resolve(load_recipe("entropy-top"), {"schedule": "linear"})
    assert p.token_fraction() == Fraction("0.2")
    with pytest.raises(ParamError):
        resolve(load_recipe("d3s"), {"sample_fraction": "0.5"})
    p = resolve(load_recipe("d3s"), {"schedule": "static", "sample_fraction": "0.5"})
    assert p.sample_fraction() == Fraction(1, 2)


def test_set_parsing_and_json_record():
    with pytest.raises(ParamError, match="given twice"):
        parse_sets(["std=sample", "std=none"])
    with pytest.raises(ParamError, match="name=value"):
        parse_sets(["std"])
    p = resolve(load_recipe("d3s"), parse_sets(["max_policy_lag=none", "progress=0.5", "difficulty_prior=1e-6"]))
    rec = json.loads(p.to_json())
    assert set(rec) == set(DEFAULTS)
    assert rec["max_policy_lag"] is None and rec["progress"] == 0.5 and rec["difficulty_prior"] == 1e-6
    assert rec["difficulty_window"] == 4 and isinstance(rec["sample_fraction_end"], int)


def test_the_recommended_recipes_say_for_what_and_recipes_shows_it(cli):
    """`rollstore recipes` marks each recommended recipe with the tasks it is recommended for and the
    μ and learning rate it is meant for; the loop's default recipe is a recommended one; names of any
    length stay aligned."""
    from rollstore.loop.driver import LoopConfig

    marked = [n for n in ALL if load_recipe(n).recommended]
    assert marked and LoopConfig(buffer="b").recipe in marked
    res = cli("recipes")
    assert res.code == 0
    lines = {ln.split()[0]: ln for ln in res.stdout.splitlines()}
    assert set(lines) == set(ALL)
    for name in marked:
        r = load_recipe(name)
        assert r.epochs >= 1 and r.lr > 0 and r.recommended_for
        assert f"[recommended for {r.recommended_for}: epochs {r.epochs}, lr {r.lr:g}]" in lines[name]
    assert sum("recommended" in ln for ln in lines.values()) == len(marked)
    assert len({ln.index(load_recipe(n).description) for n, ln in lines.items()}) == 1


def test_recommended_for_needs_recommended(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('description = "x"\nrecommended_for = "anything"\n[params]\n')
    with pytest.raises(ParamError, match="recommended_for"):
        load_recipe(str(path))


def test_the_docs_parameter_table_is_the_generated_one():
    """docs/curation.md §Parameters' table is `parameter_table()`, generated from `PARAMETERS`;
    regenerate it with `python -c "from rollstore.curate.params import parameter_table as t; print(t())"`."""
    with open(os.path.join(ROOT, "docs", "curation.md"), encoding="utf-8") as fh:
        text = fh.read()
    start = text.index("| parameter | values (default) | meaning | binds |")
    assert text[start:text.index("\n\n", start)] == parameter_table()


@pytest.mark.parametrize("p", PARAMETERS, ids=lambda p: p.name)
def test_each_parameter_is_checked_by_its_table_row(p):
    """Every row's default passes its own check; its range's ends are where the errors start."""
    assert coerce(p.name, p.default) == p.default
    if p.kind == "enum":
        for word in p.values:
            assert coerce(p.name, word) == word
        with pytest.raises(ParamError, match=f"parameter {p.name}: 'other' is not one of"):
            coerce(p.name, "other")
    if p.low is not None:
        if p.low_open:
            with pytest.raises(ParamError, match=f"parameter {p.name}: must be"):
                coerce(p.name, str(p.low))
        else:
            assert coerce(p.name, str(p.low)) == p.low
        with pytest.raises(ParamError, match=f"parameter {p.name}: must be"):
            coerce(p.name, str(p.low - 1))
    if p.high is not None:
        assert coerce(p.name, str(p.high)) == p.high
        with pytest.raises(ParamError, match=f"parameter {p.name}: must be in"):
            coerce(p.name, str(float(p.high + Fraction(1, 100))))
    if p.nullable:
        assert coerce(p.name, "none") is None
    elif p.kind in ("int", "number"):
        with pytest.raises(ParamError, match=f"parameter {p.name}: expected a decimal number"):
            coerce(p.name, "none")


def test_derived_values_are_computed_once_and_explained():
    """f and κ are derived in `Params` (DERIVED) and bind from there; K = ⌈κ·N⌉ is `Params.token_budget`;
    `--explain` shows f, and K with its formula (and its value for a concrete N)."""
    from rollstore.curate.params import Params
    from rollstore.curate.plan import build, explain

    p = resolve(load_recipe("d3s"), {"progress": "0.5", "where": "true", "current_version": "1"})
    assert p.derived == {"f": Fraction(5, 8), "κ": Fraction(3, 5)}
    assert p.bindings()["f_num"] == 5 and p.bindings()["f_den"] == 8 and p.token_budget(11) == 7
    assert Params(p.values).derived == p.derived  # a copy derives the same, from the same table
    plan = build(p, load_recipe("d3s"))
    assert plan.values == p.bindings()
    uses = [u for row in explain(plan, tokens_selected=11) for u in row["uses"]]
    assert any(u.startswith("$f_num=5 (f = 5/8") for u in uses)
    assert any("K = ⌈3/5 (0.6)·11⌉ = 7" in u for u in uses)
    assert resolve(load_recipe("grpo"), {}).token_budget(100) is None
    # one $name, one parameter: no binding is named by two
    from rollstore.curate.params import DERIVED, PARAMETERS

    names = [n for p_ in PARAMETERS for n, _ in p_.binds] + [n for d in DERIVED for n, _ in d.binds]
    assert len(names) == len(set(names))
