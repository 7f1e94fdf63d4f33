"""The curation plan: one object that the engines run and the curation id hashes, read by a person
with `rollstore recipes --explain`; token data read at most once, and never by a dry run."""

from __future__ import annotations

import dataclasses
import json
import re

import pyarrow as pa
import pytest

import rollstore.curate.run as run_module
from rollstore.curate import plan as plan_module
from rollstore.curate.kernels import KERNELS, signature
from rollstore.curate.params import builtin_recipes, load_recipe, resolve
from rollstore.curate.run import curate
from rollstore.curate.steps import Runner
from rollstore.queries import load_sql, render
from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer

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
        assert step.at in plan_module.PLACES, step  # every step declares where it runs
        assert (step.merge is not None) == (step.scope == plan_module.GLOBAL), step  # a global step names its merge
        if step.kind == "kernel":
            k = KERNELS[step.kernel]  # a session kernel reads its source table, a row kernel its columns
            assert step.text == signature(step.kernel, step.args) and step.reads == (
                ((k.source,) if k.source else k.reads) + tuple(f"rollouts.{c}" for c in k.shard_columns))
            continue
        assert step.source == load_sql(step.sql)
        assert step.text == render(step.sql, dict(step.fragments)) == step.render()
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
        render("curate_advantages", {"rows": "work"})  # `out` left unfilled: a programming error


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
    assert "curate_selected_rows" in ran and "curate_materialise" not in ran
    for name, sql in rec.sql:
        assert not any(col in _code(sql) for col in TOKEN_COLUMNS), (name, sql)


def test_only_shards_with_a_selected_row_are_opened_and_entropies_read_once(steps_buffer, monkeypatch):
    """A batch of one step in a four-step buffer: the token stage reads that step's shard only, the
    entropies are read from Parquet by the kernels (once for the token stage, once for the
    materialisation, only at the selected rows' positions), no SQL statement reads a token list
    (the candidates' scan names none: the lengths are stored, schema version 3), and
    materialisation reads no Parquet in SQL (the candidates' scan took each row's position)."""
    from rollstore.curate import entropies

    files: list[list[str]] = []
    original = run_module.parquet

    def spy(paths, located=False, numbered=False):
        files.append(list(paths))
        return original(paths, located, numbered)

    reads: list[tuple[str, str, int]] = []
    column_at = entropies.column_at

    def read_spy(path, positions, column, source):
        reads.append((path, column, len(positions)))
        return column_at(path, positions, column, source)

    monkeypatch.setattr(run_module, "parquet", spy)
    monkeypatch.setattr(entropies, "column_at", read_spy)
    rec = Recorder(monkeypatch)
    with Buffer.open(steps_buffer) as buf, buf.snapshot() as snap:
        shards = snap.files("rollouts")
        result = curate(buf, load_recipe("d3s"), {"where": "step = 1", "progress": "0.3"}, commit=False)
    n = result.record["n_selected"]
    assert n > 0 and result.curated.num_rows == n
    per_step = {name: bound for name, bound in rec.bound if bound}
    assert set(per_step) == {"curate_candidates"}
    assert all("read_parquet" not in sql for name, sql in rec.sql if name == "curate_materialise")
    # the candidates, the where's check: every shard (the `where` may match any row); then, as the buffer
    # has no checkpoint for the version's default, the run's newest policy_version over every shard
    assert files == [shards] * 3
    assert reads == [(shards[1], "entropies", n)] * 2, reads  # the token stage, then the materialisation
    assert not [name for name, sql in rec.sql if re.search(r"\bentropies\b", _code(sql)) and "read_parquet" in sql]
    token_lists = ("response_token_ids", "prompt_token_ids", "gen_logprobs", "entropies")
    candidates = [_code(sql) for name, sql in rec.sql if name == "curate_candidates"]
    assert candidates and not any(re.search(rf"\b{c}\b", sql) for sql in candidates for c in token_lists), candidates


def test_explain_prints_the_plan_in_order(cli):
    res = cli("recipes", "--explain", "d3s", "--set", "progress=0.5")
    assert res.code == 0, res.stderr
    out = res.stdout
    plan = plan_module.build(resolve(load_recipe("d3s"), {"progress": "0.5", "where": "true"}), load_recipe("d3s"))
    positions = [out.index(f"kernel {s.kernel} (version {KERNELS[s.kernel].version})" if s.kind == "kernel"
                           else f"queries/{s.sql}.sql") for s in plan.steps]
    assert positions == sorted(positions)
    assert "runs per input shard" in out and "runs per selected shard" in out and "runs on the client (whole)" in out
    assert "token='abs_adv_entropy'" in out  # a kernel step's arguments
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
    reworded = [dataclasses.replace(s, text="-- reworded\n" + s.text.replace("\n", "\n   ")) if s.kind == "sql" else s
                for s in plan.steps]
    assert dataclasses.replace(plan, steps=reworded).sha256() == plan.sha256()
    # non-ASCII text before the code (the tokenizer counts bytes, not characters)
    assert plan_module.executable("-- |A|·H, κ ≤ 1\nSELECT 'é' AS x") == "SELECT 'é' AS x"


class EngineSpy:
    """Every statement a curation executes through its session (`Session.execute`, `Session.table`)
    and every step the runner renders, in order; transport (Arrow in and out) is not SQL."""

    def __init__(self, monkeypatch):
        import threading

        from rollstore.queries.session import Session

        self.executed: list[str] = []
        self.steps: list[tuple[str, str]] = []  # (step id, rendered text)
        self.lock = threading.Lock()
        run_sql, execute, table, kernel = Runner._sql, Session.execute, Session.table, Runner.kernel
        session_kernel = Runner._session_kernel

        def spy_sql(runner, step, bound, extra):
            sql, args = run_sql(runner, step, bound, extra)
            with self.lock:
                self.steps.append((_step_id(step), sql))
            return sql, args

        def spy_kernel(runner, step, rows):
            with self.lock:
                self.steps.append((_step_id(step), step.text))
            return kernel(runner, step, rows)

        def spy_session_kernel(runner, step):
            with self.lock:
                self.steps.append((_step_id(step), step.text))
            return session_kernel(runner, step)

        def spy_execute(session, sql, params=None, reads=None):
            with self.lock:
                self.executed.append(sql)
            return execute(session, sql, params, reads)

        def spy_table(session, sql, params=None, reads=None):
            with self.lock:
                self.executed.append(sql)
            return table(session, sql, params, reads)

        monkeypatch.setattr(Runner, "_sql", spy_sql)
        monkeypatch.setattr(Runner, "kernel", spy_kernel)
        monkeypatch.setattr(Runner, "_session_kernel", spy_session_kernel)
        monkeypatch.setattr(Session, "execute", spy_execute)
        monkeypatch.setattr(Session, "table", spy_table)


def _step_id(step) -> str:
    return f"{step.phase}:{step.sql}:{step.fragments}"


# What a run executes outside the plan: the defaults it resolves before the plan exists, and the
# session's own introspection.
OUTSIDE_PLAN = ("curate_latest_step", "curate_latest_policy", "curate_batch_runs", "curate_checkpoint_runs",
                "curate_sampling_runs", "curate_work_range")


def _outside_plan(sql: str) -> bool:
    if sql == "SELECT current_setting('threads')":
        return True
    return any(_code(load_sql(name)).split("FROM")[0] in _code(sql) for name in OUTSIDE_PLAN)


def _check_engine_ran_the_plan(spy: EngineSpy, plan, ordered: bool) -> None:
    rendered = {sql for _, sql in spy.steps}
    stray = [sql for sql in spy.executed if sql not in rendered and not _outside_plan(sql)]
    assert not stray, f"statements outside the plan: {stray[:3]}"
    ids = [_step_id(s) for s in plan.steps]
    ran = [sid for sid, _ in spy.steps]
    first = [ids.index(sid) for sid in dict.fromkeys(ran)]
    assert first == sorted(first), "steps ran out of the plan's order"
    # skipped by design: the heads' and custom merges' steps, and a step whose relation the engine
    # bound to no file (the uses step when no committed audit meets the batch: `curate.steps.Audits`)
    skippable = {_step_id(s) for s in plan.steps
                 if s.merge in ("heads",) or s.merge == "custom" or "selections" in s.relations}
    assert set(ids) - set(ran) <= skippable, f"plan steps never run: {set(ids) - set(ran) - skippable}"
    if ordered:
        positions = [ids.index(sid) for sid in ran]
        assert positions == sorted(positions), "the embedded engine runs each step once, in order"


def _plan_of(result, recipe_name: str, sets: dict):
    used = json.loads(result.record["params"])
    recipe = load_recipe(recipe_name)
    params = resolve(recipe, {**sets, "where": used["where"], "current_version": used["current_version"]})
    return plan_module.build(params, recipe)


@pytest.mark.parametrize("recipe, sets", [
    ("d3s", {"progress": "0.3"}),
    ("pods", {"amplify": "da3po", "filter": "dynamic"}),
    ("grpo", {}),
])
def test_the_embedded_engine_executes_the_plan_steps_in_order(steps_buffer, monkeypatch, recipe, sets):
    with Buffer.open(steps_buffer) as buf:
        spy = EngineSpy(monkeypatch)
        result = curate(buf, load_recipe(recipe), sets, commit=False)
    _check_engine_ran_the_plan(spy, _plan_of(result, recipe, sets), ordered=True)
    assert result.record["sql_sha256"] == _plan_of(result, recipe, sets).sha256()


@pytest.mark.parametrize("recipe, sets", [
    ("d3s", {"progress": "0.3", "where": "step >= 1"}),
    ("da3po", {"where": "step >= 1", "sample": "in_group", "token": "entropy"}),
])
def test_the_dask_engine_executes_the_plan_steps_in_order(steps_buffer, monkeypatch, recipe, sets):
    """In-process Dask workers (threads), so the spy sees every task's statements."""
    distributed = pytest.importorskip("distributed")
    from rollstore.curate.dask_client import curate_dask
    from rollstore.curate.options import Dask

    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0") as client, \
            Buffer.open(steps_buffer) as buf:
        embedded = curate(buf, load_recipe(recipe), sets, commit=False)
        spy = EngineSpy(monkeypatch)
        result = curate_dask(buf, load_recipe(recipe), sets, dask=Dask(client, 3), commit=False)
    assert result.curation_id == embedded.curation_id and result.audit.equals(embedded.audit)
    _check_engine_ran_the_plan(spy, _plan_of(result, recipe, sets), ordered=False)


def test_every_global_step_has_a_registered_merge_with_a_handler_in_both_engines():
    from rollstore.curate.merges import MERGES
    from rollstore.curate.run import HANDLERS

    for name in builtin_recipes():
        recipe = load_recipe(name)
        for sets in ({}, {"amplify": "da3po", "filter": "dynamic", "token": "entropy", "sample": "cross_group"}):
            plan = plan_module.build(resolve(recipe, {**sets, "where": "true", "current_version": "0"}), recipe)
            for step in plan.steps:
                if step.scope == plan_module.GLOBAL:
                    assert step.merge in MERGES and step.merge in HANDLERS, step
                    if MERGES[step.merge].combine is None:
                        assert step.result or step.writes, step


def test_a_kernel_step_is_hashed_by_its_name_version_and_arguments(monkeypatch):
    from rollstore.curate import kernels

    recipe = load_recipe("d3s")
    plan = plan_module.build(resolve(recipe, {"where": "true", "current_version": "0"}), recipe)
    assert [s.kernel for s in plan.steps if s.kind == "kernel"] == ["max_variance", "missing_entropies",
                                                                    "token_histogram", "token_heads", "tokens_kept",
                                                                    "entropies", "keep_runs", "fallback"]
    none = plan_module.build(resolve(recipe, {"where": "true", "current_version": "0", "token": "none"}), recipe)
    assert [s.kernel for s in none.steps if s.kind == "kernel"] == ["max_variance", "keep_runs", "fallback"]
    entropy = plan_module.build(resolve(recipe, {"where": "true", "current_version": "0", "token": "entropy"}), recipe)
    keep = [s for s in entropy.steps if s.kernel == "keep_runs"][0]
    assert keep.args == (("token", "entropy"),)
    monkeypatch.setitem(kernels.KERNELS, "keep_runs", dataclasses.replace(kernels.KERNELS["keep_runs"], version="2"))
    bumped = plan_module.build(resolve(recipe, {"where": "true", "current_version": "0"}), recipe)
    assert bumped.sha256() != plan.sha256()


@pytest.mark.parametrize("bad, message", [
    (lambda rows, values, args: {"keep_runs": pa.array([[0, 1]] * (rows.num_rows + 1), pa.list_(pa.int32()))},
     "column 'keep_runs': returned {n1} values of list<item: int32>, declared {n} values of list<item: int32>"),
    (lambda rows, values, args: {"keep_runs": pa.array([1] * rows.num_rows, pa.int64())},
     "column 'keep_runs': returned {n} values of int64, declared {n} values of list<item: int32>"),
    (lambda rows, values, args: {"mask": pa.array([[0, 1]] * rows.num_rows, pa.list_(pa.int32()))},
     "returned columns mask, declared keep_runs"),
    (lambda rows, values, args: [1, 2], "returned list, declared keep_runs"),
])
def test_a_kernel_that_returns_the_wrong_relation_stops_the_run_with_one_line_and_commits_nothing(
        steps_buffer, monkeypatch, bad, message):
    from rollstore.curate import kernels
    from rollstore.curate.params import CurationError

    monkeypatch.setitem(kernels.KERNELS, "keep_runs", dataclasses.replace(kernels.KERNELS["keep_runs"], fn=bad))
    with Buffer.open(steps_buffer) as buf:
        dry = curate(buf, load_recipe("d3s"), {"progress": "0.3"}, dry_run=True)  # runs no kernel
        before = {t: buf.manifest.live_paths(t) for t in ("curated", "selections", "curations")}
        with pytest.raises(CurationError) as err:
            curate(buf, load_recipe("d3s"), {"progress": "0.3"})
        text = str(err.value)
        assert "\n" not in text and text.startswith("kernel step keep_runs (version 1): "), text
        n = dry.record["n_selected"]
        assert message.format(n=n, n1=n + 1) in text and "nothing was committed" in text, text
        assert {t: buf.manifest.live_paths(t) for t in before} == before
        assert buf.manifest.live_key_count("curations", dry.curation_id) == 0


def test_a_kernel_with_the_wrong_relation_stops_a_dask_run_with_the_same_line(steps_buffer, monkeypatch):
    """In-process Dask workers (threads), so the patched kernel is the one the tasks run."""
    distributed = pytest.importorskip("distributed")
    from rollstore.curate import kernels
    from rollstore.curate.dask_client import curate_dask
    from rollstore.curate.options import Dask
    from rollstore.curate.params import CurationError

    def short(rows, values, args):
        return {"fallback": pa.array([False] * (rows.num_rows - 1), pa.bool_())}

    monkeypatch.setitem(kernels.KERNELS, "fallback", dataclasses.replace(kernels.KERNELS["fallback"], fn=short))
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0") as client, \
            Buffer.open(steps_buffer) as buf:
        before = {t: buf.manifest.live_paths(t) for t in ("curated", "selections", "curations")}
        with pytest.raises(CurationError) as err:
            curate_dask(buf, load_recipe("d3s"), {"progress": "0.3"}, dask=Dask(client, 2))
        assert {t: buf.manifest.live_paths(t) for t in before} == before
    text = str(err.value)
    assert "\n" not in text and text.startswith("kernel step fallback (version 1): column 'fallback': returned "), text
    assert "values of bool, declared" in text and "nothing was committed" in text, text


@pytest.mark.parametrize("name", builtin_recipes())
@pytest.mark.parametrize("sets", [{}, {"replay": "window", "amplify": "da3po", "max_reuse": "1"}])
def test_every_sql_step_declares_the_tables_its_text_names(name, sets):
    """A reused session makes a changed table's view only for the steps that declare the table
    (`steps.step_tables`): every table a step's SQL names (comments left out) must be declared, or the
    statement would fail on a rebound session (a new session has every view, so only the loop would
    show it)."""
    from rollstore.curate.steps import step_tables
    from rollstore.storage.schema import TABLES

    import duckdb

    def identifiers(sql: str) -> set[str]:  # names as DuckDB's tokenizer reads them: no comment, no string
        raw = sql.encode()
        tokens = duckdb.tokenize(sql)
        ends = [start for start, _ in tokens[1:]] + [len(raw)]
        return {raw[a:b].decode().strip().strip('"').lower() for (a, kind), b in zip(tokens, ends)
                if kind == duckdb.token_type.identifier}

    recipe = load_recipe(name)
    if recipe.sql is not None:
        pytest.skip("a custom recipe's SELECT makes every view (step_tables: None)")
    plan = plan_module.build(resolve(recipe, {"where": "step = 1", **sets}), recipe, None)
    checked = 0
    for step in plan.steps:
        if step.kind != "sql":
            continue
        named = identifiers(step.render()) & set(TABLES)
        assert named <= step_tables(step, {}), (step.sql, named - step_tables(step, {}))
        checked += 1
    assert checked > 5


def test_a_loop_curation_of_a_new_step_makes_no_table_view(tmp_path):
    """Through a session reused step after step (as the loop does), a d3s curation of the newest step
    makes no view of the tables whose files changed (rollouts, curated, selections, curations): it
    reads the rollouts shards as a relation, the record and audit of earlier steps not at all (their
    ids meet no audit: the uses step is skipped), and checks its `where` over its own relation."""
    from rollstore.builtin.synthetic import RowOptions
    from rollstore.queries.session import Session

    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        session = Session(buf.snapshot())
        try:
            for step in range(3):
                buf.append_rollouts(rollouts_table(n_groups=4, group_size=4, mean_tokens=5, step=step,
                                                   options=RowOptions(id_prefix=f"s{step}")))
                got = curate(buf, load_recipe("d3s"), {"where": f"step = {step}", "progress": "0.5"},
                             session=session)
                assert got.record["n_selected"] > 0
                assert {"rollouts", "curated"} <= session._stale
            assert {"selections", "curations"} <= session._stale
        finally:
            session.close()
