"""The curation plan: one object that the engines run and the curation id hashes, read by a person
with `rollstore recipes --explain`; token data read at most once, and never by a dry run."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

import curate.run as run_module
from curate import plan as plan_module
from curate.params import builtin_recipes, load_recipe, resolve
from curate.run import curate
from curate.steps import Runner
from queries import load_sql, render
from rollstore.synthetic import rollouts_table
from storage.buffer import Buffer

TOKEN_COLUMNS = ("response_token_ids", "prompt_token_ids", "gen_logprobs", "old_logprobs")


@pytest.fixture(scope="module")
def steps_buffer(tmp_path_factory):
    """Four steps, one shard each; step 3 is the default batch."""
    root = str(tmp_path_factory.mktemp("plan") / "buf")
    with Buffer.init(root) as buf:
        for step in range(4):
            buf.append_rollouts(rollouts_table(n_groups=10, group_size=8, step=step, policy_version=step, seed=11))
    return root


def _code(sql: str) -> str:
    """SQL without its comments (the comments may name columns a statement does not read)."""
    return re.sub(r"--[^\n]*", "", sql)


class Recorder:
    """Every statement the runner executes, and the files bound into each step."""

    def __init__(self, monkeypatch):
        self.sql: list[tuple[str, str]] = []
        self.bound: list[tuple[str, dict]] = []
        original = Runner._sql

        def spy(runner, step, bound, extra):
            sql, args = original(runner, step, bound, extra)
            self.sql.append((step.sql, sql))
            self.bound.append((step.sql, dict(bound)))
            return sql, args

        monkeypatch.setattr(Runner, "_sql", spy)


@pytest.mark.parametrize("name", builtin_recipes())
def test_every_step_is_one_sql_file_and_the_plan_text_is_what_runs(name):
    recipe = load_recipe(name)
    params = resolve(recipe, {"where": "true", "current_version": "0"})
    plan = plan_module.build(params, recipe)
    assert plan.steps and {s.phase for s in plan.steps} <= set(plan_module.PHASES)
    order = [plan_module.PHASES.index(s.phase) for s in plan.steps]
    assert order == sorted(order), "steps run phase after phase"
    for step in plan.steps:
        assert step.source == load_sql(step.sql)
        assert step.text == render(step.sql, dict(step.fragments)) == step.render()
        assert (step.merge is not None) == (step.scope == plan_module.GLOBAL), step  # a global step names its merge
    assert plan.sha256() != plan_module.build(resolve(recipe, {"where": "false", "current_version": "0"}), recipe).sha256()


def test_the_curation_id_is_the_hash_of_the_plan(steps_buffer):
    with Buffer.open(steps_buffer) as buf:
        result = curate(buf, load_recipe("d3s"), {"progress": "0.3"}, commit=False)
        snapshot = buf.manifest.latest_seq()
    used = json.loads(result.record["params"])
    params = resolve(load_recipe("d3s"), {"progress": "0.3", "where": used["where"],
                                          "current_version": used["current_version"]})
    plan = plan_module.build(params, load_recipe("d3s"))
    assert result.record["sql_sha256"] == plan.sha256()
    assert result.curation_id == plan.curation_id(snapshot)


def test_a_fragment_inside_a_user_predicate_is_not_substituted():
    """`{rows}` typed in a `where` stays text: fragments are filled in one pass over the file's text."""
    recipe = load_recipe("pods")
    params = resolve(recipe, {"where": "prompt <> '{rows}'", "current_version": "0"})
    candidates = plan_module.build(params, recipe).steps[0]
    assert "prompt <> '{rows}'" in candidates.text
    with pytest.raises(KeyError):
        render("curate_group_stats", {"rows": "work"})  # `out` left unfilled: a programming error


def test_dry_run_never_reads_token_ids_or_logprobs(steps_buffer, monkeypatch):
    """The what-if audit of d3s: same record numbers and audit as the full run; no statement it runs
    names a token-id or log-prob column, and it writes nothing."""
    with Buffer.open(steps_buffer) as buf:
        seq = buf.manifest.latest_seq()
        full = curate(buf, load_recipe("d3s"), {"progress": "0.3"}, commit=False)
        rec = Recorder(monkeypatch)
        dry = curate(buf, load_recipe("d3s"), {"progress": "0.3"}, dry_run=True)
        assert buf.manifest.latest_seq() == seq and not dry.committed and dry.curated is None
    assert dry.curation_id == full.curation_id
    assert dry.audit.equals(full.audit)
    for key in ("n_candidates", "n_selected", "tokens_candidate", "tokens_kept", "token_threshold", "adv_var_after"):
        assert dry.record[key] == full.record[key]
    assert dry.record["old_logprobs_fallback"] is None and full.record["old_logprobs_fallback"] == 0
    ran = [name for name, _ in rec.sql]
    assert "curate_token_entropies" in ran and "curate_materialise" not in ran
    for name, sql in rec.sql:
        assert not any(col in _code(sql) for col in TOKEN_COLUMNS), (name, sql)


def test_only_shards_with_a_selected_row_are_opened_and_entropies_read_once(steps_buffer, monkeypatch):
    """A batch of one step in a four-step buffer: the token and materialisation steps read that
    step's shard only, and the entropies are read from Parquet by one statement."""
    files: list[list[str]] = []
    original = run_module.parquet

    def spy(paths, located=False):
        files.append(list(paths))
        return original(paths, located)

    monkeypatch.setattr(run_module, "parquet", spy)
    rec = Recorder(monkeypatch)
    with Buffer.open(steps_buffer) as buf, buf.snapshot() as snap:
        shards = snap.files("rollouts")
        result = curate(buf, load_recipe("d3s"), {"where": "step = 1", "progress": "0.3"}, commit=False)
    assert result.record["n_selected"] > 0 and result.curated.num_rows == result.record["n_selected"]
    per_step = {name: bound for name, bound in rec.bound if bound}
    assert set(per_step) == {"curate_candidates", "curate_token_entropies", "curate_materialise"}
    assert files[0] == shards  # the candidates: every shard (the `where` may match any row)
    assert all(f == [shards[1]] for f in files[1:]), files
    reads_entropies = [name for name, sql in rec.sql if re.search(r"(?<!e\.)\bentropies\b", _code(sql))
                       and "read_parquet" in sql]  # e.entropies: the in-session table, not Parquet
    assert reads_entropies == ["curate_candidates", "curate_token_entropies"]  # lengths, then the values once


def test_explain_prints_the_plan_in_order(cli):
    res = cli("recipes", "--explain", "d3s", "--set", "progress=0.5")
    assert res.code == 0, res.stderr
    out = res.stdout
    plan = plan_module.build(resolve(load_recipe("d3s"), {"progress": "0.5", "where": "true"}), load_recipe("d3s"))
    positions = [out.index(f"queries/{s.sql}.sql") for s in plan.steps]
    assert positions == sorted(positions)
    assert "$f_num=5" in out and "$f_den=8" in out  # f(0.5) = 1/4 + 3/4·1/2 = 5/8
    assert "rollouts.entropies" in out and "(at run time)" in out
    bad = cli("recipes", "--explain", "no-such-recipe")
    assert bad.code != 0 and "unknown recipe" in bad.stderr


def test_comments_and_spacing_do_not_change_the_hash_but_code_does():
    sql = "-- why\nSELECT a,  b /* note */\n  FROM t WHERE s = '-- kept' AND x > $thr -- tail\n"
    same = "SELECT a, b FROM t\nWHERE s = '-- kept' AND x > $thr"
    assert plan_module.executable(sql) == plan_module.executable(same)
    for changed in ("SELECT a, b FROM t WHERE s = '--  kept' AND x > $thr",   # inside a literal
                    "SELECT a, b FROM t WHERE s = '-- kept' AND x >= $thr",
                    "SELECT b, a FROM t WHERE s = '-- kept' AND x > $thr"):
        assert plan_module.executable(changed) != plan_module.executable(sql), changed
    recipe = load_recipe("d3s")
    plan = plan_module.build(resolve(recipe, {"where": "true", "current_version": "0"}), recipe)
    reworded = [dataclasses.replace(s, text="-- reworded\n" + s.text.replace("\n", "\n   ")) for s in plan.steps]
    assert dataclasses.replace(plan, steps=reworded).sha256() == plan.sha256()
    # non-ASCII text before the code (the tokenizer counts bytes, not characters)
    assert plan_module.executable("-- |A|·H, κ ≤ 1\nSELECT 'é' AS x") == "SELECT 'é' AS x"
