"""Pre-rollout prompt selection (curate/prompts.py, docs/curation.md §Before generation) against a
brute-force reference written from the algorithm's statement: z, the kind, p = 1 − p_e^z, the seeded
draws, the stream order, the fill rule and the per-kind rate adaptation, over real buffers."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollstore.curate.params import ParamError, load_recipe, resolve
from rollstore.curate.prompts import draw, prompt_plan, select
from rollstore.queries.session import Session
from rollstore.storage.buffer import Buffer
from rollstore.builtin.synthetic import rollouts_table
from rollout_helpers import default_tiny, tiny_cache  # noqa: F401  (fixtures)

G = 3  # samples per group


class P:
    def __init__(self, i: int):
        self.prompt_id, self.prompt = f"p{i}", f"prompt {i}"


def step_table(run_id: str, step: int, groups: list[tuple[int, list[float]]]) -> pa.Table:
    """One step of `run_id`: a group of G rows per (prompt index, rewards)."""
    t = rollouts_table(n_groups=len(groups), group_size=G, run_id=run_id, step=step, seed=step)
    prompts = [g[0] for g in groups for _ in range(G)]
    rewards = [r for g in groups for r in g[1]]
    t = t.set_column(t.schema.get_field_index("prompt_id"), "prompt_id", pa.array([f"p{i}" for i in prompts]))
    t = t.set_column(t.schema.get_field_index("prompt"), "prompt", pa.array([f"prompt {i}" for i in prompts]))
    t = t.set_column(t.schema.get_field_index("reward"), "reward", pa.array(rewards, pa.float32()))
    t = t.set_column(t.schema.get_field_index("correct"), "correct", pa.array([r == 1.0 for r in rewards]))
    return t.set_column(t.schema.get_field_index("verify_error"), "verify_error", pa.nulls(len(rewards), pa.string()))


def reference(history: dict[int, list[tuple[int, str, list[float]]]], params: dict, rates: tuple[float, float],
              run_id: str, step: int, seed: int, stream: list[int], need: int, limit: int):
    """Straight from the statement: per prompt its groups newest first (step, then group id, desc),
    the first `window`; z = leading zero-variance ones; p = 1 − p_e(kind)^z; skip iff draw < p;
    examine in order until `need` generate or `limit` examined; then fill with the skipped, in order."""
    out, chosen = [], 0
    for pos in stream[:limit]:
        if chosen >= need:
            break
        groups = sorted(history.get(pos, []), key=lambda g: (g[0], g[1]), reverse=True)[:params["skip_window"]]
        z = 0
        for _, _, rewards in groups:
            if len(set(rewards)) != 1:
                break
            z += 1
        kind = None if z == 0 else ("all_correct" if all(r == 1.0 for r in groups[0][2]) else "all_wrong")
        pe = rates[0] if kind == "all_correct" else rates[1]
        p = 1.0 - pe ** z if z else 0.0
        skip = draw(seed, run_id, step, f"p{pos}") < p
        out.append([pos, len(groups), z, kind, p, "skip" if skip else "generate"])
        chosen += not skip
    for row in out:
        if chosen >= need:
            break
        if row[5] == "skip":
            row[5] = "filled"
            chosen += 1
    return out


group = st.tuples(st.integers(0, 4), st.lists(st.sampled_from([0.0, 1.0, 0.5]), min_size=G, max_size=G))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.lists(group, min_size=1, max_size=5), min_size=1, max_size=4),
       other=st.lists(group, min_size=1, max_size=3), window=st.integers(1, 4),
       need=st.integers(1, 6), seed=st.integers(0, 3))
def test_selection_matches_the_reference(tmp_path_factory, steps, other, window, need, seed):
    root = str(tmp_path_factory.mktemp("skip") / "buf")
    history: dict[int, list] = {}
    with Buffer.init(root) as buf:
        for s, groups in enumerate(steps):
            t = step_table("run", s, groups)
            buf.append_rollouts(t)
            gids = t.column("group_id").to_pylist()[::G]
            for (prompt, rewards), gid in zip(groups, gids):
                history.setdefault(prompt, []).append((s, gid, rewards))
        buf.append_rollouts(step_table("other-run", 0, [(i, [1.0] * G) for i, _ in other]))  # never read
        params = resolve(load_recipe("greso"), {"skip_window": window, "skip_explore_start": "0.3"})
        stream = [0, 1, 2, 3, 4, 5, 3, 1]  # prompt 5 has no history; 3 and 1 come twice
        with buf.snapshot() as snap, Session(snap) as session:
            sel = select(session, prompt_plan(params), run_id="run", step=len(steps), seed=seed, stream=lambda k: P(stream[k]),
                         start=0, need=need, limit=len(stream))
    ref = reference(history, {"skip_window": window}, (0.3, 0.3), "run", len(steps), seed, stream, need, len(stream))
    got = [[stream[r["position"]], r["groups_seen"], r["z"], r["kind"], r["p_skip"],
            "filled" if r["reason"] == "filled" else r["decision"]] for r in sel.rows]
    assert [g[:4] + g[5:] for g in got] == [r[:4] + r[5:] for r in ref]
    assert all(math.isclose(g[4], r[4], rel_tol=1e-12) for g, r in zip(got, ref))
    assert [c.prompt_id for c in sel.chosen] == [f"p{r[0]}" for r in ref if r[5] != "skip"]
    assert sel.next_position == len(ref)
    assert all(r["reason"] == "no_history" for r in sel.rows if r["groups_seen"] == 0)
    assert sel.table().num_rows == len(ref)


def test_rates_adapt_per_kind_from_the_previous_selection(tmp_path):
    """Step 1's rates come from step 0's record and what step 0 generated: the zero-variance share of
    its groups (3 of 4) is over the target, all-correct groups occurred (down by skip_step) and no
    all-wrong group did (up), each clamped to [skip_explore_min, 1]."""
    root = str(tmp_path / "buf")
    params = resolve(load_recipe("greso"), {"skip_explore_start": "0.5", "skip_step": "0.2", "skip_target": "0.5"})
    with Buffer.init(root) as buf:
        with buf.snapshot() as snap, Session(snap) as s:
            sel = select(s, prompt_plan(params), run_id="r", step=0, seed=0, stream=lambda k: P(k), start=0, need=4, limit=4)
        assert {(r["explore_easy"], r["explore_hard"]) for r in sel.rows} == {(0.5, 0.5)}
        buf.append("prompt_selections", sel.table())
        buf.append_rollouts(step_table("r", 0, [(0, [1.0] * G), (1, [1.0] * G), (2, [1.0] * G), (3, [0.0, 1.0, 1.0])]))
        with buf.snapshot() as snap, Session(snap) as s:
            sel = select(s, prompt_plan(params), run_id="r", step=1, seed=0, stream=lambda k: P(k), start=0, need=4, limit=4)
        assert {(round(r["explore_easy"], 9), round(r["explore_hard"], 9)) for r in sel.rows} == {(0.3, 0.7)}
        # prompts 0..2 were all-correct once: p = 1 − 0.3; prompt 3's group had variance: never skipped
        assert [(r["prompt_id"], r["z"], r["kind"], round(r["p_skip"], 6)) for r in sel.rows] == [
            ("p0", 1, "all_correct", 0.7), ("p1", 1, "all_correct", 0.7), ("p2", 1, "all_correct", 0.7),
            ("p3", 0, None, 0.0)]


def test_parameters_and_recipe_training_keys_are_checked(tmp_path):
    for name, bad in [("skip_window", "0"), ("skip_target", "1.5"), ("skip_explore_min", "0"),
                      ("skip_step", "-0.1"), ("prompt_skip", "always"), ("skip_explore_start", "nan")]:
        with pytest.raises(ParamError, match=name):
            resolve(load_recipe("greso"), {name: bad})
    for text, word in [("epochs = 0", "epochs"), ("epochs = 2.5", "epochs"), ("epochs = true", "epochs"),
                       ('epochs = "two"', "epochs"), ("lr = -1e-4", "lr"), ("lr = nan", "lr"),
                       ('recommended = "yes"', "recommended")]:
        path = tmp_path / "r.toml"
        path.write_text(f'description = "x"\n{text}\n[params]\n')
        with pytest.raises(ParamError, match=word) as err:
            load_recipe(str(path))
        assert "\n" not in str(err.value) and str(path) in str(err.value)
    path.write_text('description = "x"\nepochs = 3\nlr = 2e-4\nrecommended = true\n[params]\n')
    r = load_recipe(str(path))
    assert (r.epochs, r.lr, r.recommended) == (3, 2e-4, True)


def test_loop_selects_before_generating_and_resumes(tmp_path, default_tiny):  # noqa: F811
    """The loop with greso on a pool it revisits every step: each step's batch is exactly the prompts its
    selection generated (no over-generation), every examined prompt is recorded once, the stream
    continues where the previous step stopped, μ = 2 trains each batch twice, and a resumed run goes on."""
    from test_loop import small, sql

    from rollstore.loop import run_loop

    root = str(tmp_path / "buf")
    Buffer.init(root).close()
    cfg = small(root, default_tiny, recipe="greso", iterations=2, prompts_per_iter=8, pool_size=8, epochs=2,
                sets={"skip_explore_start": "0.05"})
    summary = run_loop(cfg)
    assert summary["epochs"] == 2 and len(summary["skips"]) == 2
    summary = run_loop(small(root, default_tiny, recipe="greso", iterations=4, prompts_per_iter=8, pool_size=8,
                             epochs=2, sets={"skip_explore_start": "0.05"}))
    assert [r["iteration"] for r in summary["iterations"]] == [2, 3]
    rows = sql(root, "SELECT step, position, prompt_id, decision, reason FROM prompt_selections ORDER BY step, position")
    steps_ = sorted({r[0] for r in rows})
    assert steps_ == [0, 1, 2, 3]
    assert {r[4] for r in rows if r[0] == 0} == {"no_history"}
    assert [r[1] for r in rows] == list(range(len(rows)))  # the stream goes on from step to step, no gap
    for s in steps_:
        chosen = sorted(r[2] for r in rows if r[0] == s and r[3] == "generate")
        got = sql(root, f"SELECT prompt_id FROM rollouts WHERE step = {s} GROUP BY group_id, prompt_id")
        assert sorted(g[0] for g in got) == chosen and len(chosen) == 8
    assert any(r[3] == "skip" for r in rows) or any(r[4] == "filled" for r in rows)
    # each step's decisions are committed with the rollouts they chose: one commit, no other
    with Buffer.open(root) as buf:
        added = {}
        for sh in buf.manifest.shards():
            added.setdefault(sh.added_seq, []).append(sh.table_name)
    assert sum(t.count("prompt_selections") for t in added.values()) == 4
    assert all(t.count("rollouts") == 1 for t in added.values() if "prompt_selections" in t)
    # `rollstore audit --skips` counts what the table holds; a second run makes --run necessary
    import json

    from typer.testing import CliRunner

    from rollstore.cli import app

    res = CliRunner().invoke(app, ["audit", root, "--skips", "-f", "json"])
    assert res.exit_code == 0, res.output
    steps = json.loads(res.output)["steps"]
    assert [r["examined"] for r in steps] == [sum(1 for x in rows if x[0] == s) for s in steps_]
    assert sum(r["skipped"] for r in steps) == sum(1 for x in rows if x[3] == "skip")
    with Buffer.open(root) as buf, buf.snapshot() as snap:
        other = snap.arrow("prompt_selections").to_table().slice(0, 1)
        buf.append("prompt_selections", other.set_column(0, "run_id", pa.array(["other"])))
    res = CliRunner().invoke(app, ["audit", root, "--skips"])
    assert res.exit_code == 1 and "2 runs have prompt selections (other, t): name one with --run" in res.output
    # the report's section shows each step's counts (queries/report_prompt_skips.sql)
    from rollstore.report.page import build_report

    build_report(Buffer.open(root), str(tmp_path / "r.html"))
    html = (tmp_path / "r.html").read_text()
    assert 'id="skips"' in html and "Share of examined prompts skipped" in html
    # μ = 2: twice the optimiser passes of one (the training rows of a curation come in two passes)
    per_curation = sql(root, "SELECT curation_id, count(*) FROM training GROUP BY curation_id")
    assert per_curation and all(n % 2 == 0 for _, n in per_curation)


def test_greso_needs_a_pool(tmp_path, default_tiny):  # noqa: F811
    from test_loop import small

    from rollstore.loop import run_loop

    root = str(tmp_path / "buf")
    Buffer.init(root).close()
    with pytest.raises(ParamError, match="pool"):
        run_loop(small(root, default_tiny, recipe="greso", pool_size=0))


def test_prompt_selection_is_a_plan_and_is_refused_where_it_does_nothing():
    """Its steps, hash and --explain rows come from one plan object (`prompt_plan`); `generate --follow`
    refuses it in one line (the TRL plug-in and a many-rank loop call the same `refuse`)."""
    from typer.testing import CliRunner

    from rollstore.cli import app
    from rollstore.curate.prompts import refuse
    from rollstore.loop.generator import Follow

    params = resolve(load_recipe("greso"), {"skip_window": "3"})
    plan = prompt_plan(params)
    assert [s.sql for s in plan.steps] == ["prompt_history", "prompt_skip_state"]
    assert plan.values["skip_window"] == 3 and "$skip_window" in plan.steps[0].text
    assert prompt_plan(resolve(load_recipe("grpo"), {})) is None
    res = CliRunner().invoke(app, ["recipes", "--explain", "greso", "--set", "skip_window=3"])
    assert res.exit_code == 0 and "P1. prompts" in res.output and "$skip_window=3" in res.output
    assert plan.sha256()[:16] in res.output
    with pytest.raises(ParamError) as info:
        Follow(1, "greso")
    assert "generate --follow" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ParamError, match="the TRL plug-in"):
        refuse(params, "the TRL plug-in")
    Follow(1, "d3s", {"prompt_skip": "none"})  # nothing to refuse
