"""Replay curations (docs/replay.md) against the brute-force reference (tests/reference.py
`reference_replay_curate`), through the real call path, and the accounting of uses."""

from __future__ import annotations

import datetime as dt
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollstore.curate.params import CurationError, ParamError, load_recipe
from rollstore.curate.run import curate
from conftest import example_root
from reference import reference_replay_curate
from rollstore.storage.buffer import Buffer
from rollstore.storage.schema import ROLLOUTS
from test_curate_reference import compare

EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def _row(run: str, step: int, version: int, g: int, i: int, correct, reward: float, n_tok: int, prompt: int) -> dict:
    return {
        "rollout_id": f"{run}-s{step}g{g}{'ab'[i % 2]}{i}", "group_id": f"{run}-s{step}-g{g}",
        "prompt_id": f"p{prompt}", "sample_idx": i, "run_id": run, "step": step, "policy_version": version,
        "prompt": "q", "prompt_token_ids": [1, 2], "response": "a", "response_token_ids": list(range(3, 3 + n_tok)),
        "gen_logprobs": [-0.5] * n_tok, "old_logprobs": [-0.25] * n_tok,
        "entropies": [0.1 * ((i + j) % 7) for j in range(n_tok)], "finish_reason": "stop",
        "reward": reward, "correct": correct, "gold_answer": "1", "verify_error": None, "source": "t",
        "created_at": EPOCH + dt.timedelta(minutes=step), "meta": None,
    }


@st.composite
def runs(draw):
    """Steps 0..S of one run (step s sampled by version s), one step of another run, each step's
    groups mixed, all-correct or all-wrong, rewards binary or shaped; the batch is the last step."""
    n_steps = draw(st.integers(2, 4))
    shaped = draw(st.booleans())
    rows = []
    for step in range(n_steps):
        for g in range(draw(st.integers(1, 4))):
            size = draw(st.integers(1, 5))
            mode = draw(st.sampled_from(["mixed", "mixed", "all_correct", "all_wrong"]))
            prompt = draw(st.integers(0, 3))
            for i in range(size):
                correct = {"mixed": draw(st.booleans()), "all_correct": True, "all_wrong": False}[mode]
                verdict = draw(st.sampled_from([correct] * 9 + [None]))
                reward = float(correct) + (draw(st.sampled_from([0.0, -0.25, 0.1])) if shaped else 0.0)
                rows.append(_row("run", step, step, g, i, verdict, reward, draw(st.integers(1, 4)), prompt))
    rows += [_row("other", 0, n_steps - 2, 0, i, i % 2 == 0, float(i % 2 == 0), 2, 0) for i in range(3)]
    return rows


def _buffer(rows) -> Buffer:
    buf = Buffer.init(example_root("rs-replay-"))
    for step in sorted({(r["run_id"], r["step"]) for r in rows}):
        part = [r for r in rows if (r["run_id"], r["step"]) == step]
        buf.append_rollouts(pa.Table.from_pylist(part, schema=ROLLOUTS), f"{step}")
    return buf


def _check(rows, recipe: str, sets: dict, prior: dict | None = None, buf: Buffer | None = None):
    own = buf is None
    buf = buf or _buffer(rows)
    try:
        last = max(r["step"] for r in rows if r["run_id"] == "run")
        result = curate(buf, load_recipe(recipe), {"where": f"run_id = 'run' AND step = {last}", **sets})
        params = {**{k: v for k, v in load_recipe(recipe).presets.items()}, **sets}
        params = {k: (v if isinstance(v, (int, str)) and not isinstance(v, bool) else str(v)) for k, v in params.items()}
        batch = {r["rollout_id"] for r in rows if r["run_id"] == "run" and r["step"] == last}
        ref = reference_replay_curate(rows, batch, params, current_version=last, prior_selected_counts=prior)
        compare(buf, result, ref)
        audit = {r["rollout_id"]: r for r in result.audit.to_pylist()}
        for rid, exp in ref["selections"].items():
            for col in ("replayed", "age", "uses"):
                assert audit[rid][col] == exp[col], (rid, col)
        return result
    finally:
        if own:
            buf.close()


SETTINGS = dict(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("recipe, sets", [
    ("replay-groups", {}),
    ("replay-rollouts", {}),
    ("replay-rollouts", {"replay_count": "3", "replay_decay": "0.25", "replay_window": "3"}),
    ("replay-window", {}),
    ("replay-d3s", {"progress": "0.3"}),
    ("replay-groups", {"amplify": "da3po", "sample": "cross_group", "token": "abs_adv_entropy"}),
    ("grpo", {"replay": "groups", "std": "population", "replay_window": "1"}),
])
@settings(**SETTINGS)
@given(rows=runs())
def test_replay_matches_the_reference(recipe, sets, rows):
    _check(rows, recipe, sets)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=runs())
def test_uses_count_committed_curations_and_the_cap_refuses_with_reused(rows):
    """Curating the last step twice: the second curation sees every row the first selected as used
    once; with replay_max_uses 1 those rows are `reused` (a replayed row at its cap still counts in
    its group's advantages)."""
    buf = _buffer(rows)
    try:
        first = _check(rows, "replay-rollouts", {}, buf=buf)
        prior = {r["rollout_id"]: 1 for r in first.audit.to_pylist() if r["selected"]}
        second = _check(rows, "replay-window", {"replay_max_uses": "1", "replay_window": "2"}, prior, buf=buf)
        reused = {r["rollout_id"] for r in second.audit.to_pylist() if r["reason"] == "reused"}
        assert reused == set(prior) & {r["rollout_id"] for r in second.audit.to_pylist()}
    finally:
        buf.close()


def test_replay_refuses_a_batch_of_several_runs_and_bad_parameters(tmp_path):
    rows = [_row("a", 0, 0, 0, i, i % 2 == 0, float(i % 2 == 0), 2, 0) for i in range(4)]
    rows += [_row("b", 1, 1, 0, i, i % 2 == 0, float(i % 2 == 0), 2, 0) for i in range(4)]
    with _buffer(rows) as buf:
        seq = buf.manifest.latest_seq()
        with pytest.raises(CurationError, match=r"parameter replay: the batch holds rows of 2 runs \('a', 'b'\)"):
            curate(buf, load_recipe("replay-groups"), {"where": "true"})
        for name in ("replay_window", "replay_max_uses"):
            with pytest.raises(ParamError, match=f"parameter {name}: must be ≥ 1"):
                curate(buf, load_recipe("replay-groups"), {"where": "true", name: "0"})
        assert buf.manifest.latest_seq() == seq  # nothing committed


def test_the_plan_and_the_record_name_the_replay_parameters():
    from rollstore.curate import plan as plan_module
    from rollstore.curate.params import resolve

    recipe = load_recipe("replay-groups")
    plan = plan_module.build(resolve(recipe, {"where": "step = 3", "current_version": "3"}), recipe)
    names = [s.sql for s in plan.steps]
    assert names.index("curate_filter") < names.index("curate_replay") < names.index("curate_replay_apply") \
        < names.index("curate_select_all")
    code = plan_module.executable
    assert "replay_window" in code(plan.steps[0].text) and plan.values["replay_mode"] == "groups"
    grpo = plan_module.build(resolve(load_recipe("grpo"), {"where": "step = 3", "current_version": "3"}),
                             load_recipe("grpo"))
    assert "curate_replay" not in [s.sql for s in grpo.steps] and "replay_window" not in code(grpo.steps[0].text)
    params = json.loads(plan.params.to_json())
    assert params["replay"] == "groups" and params["replay_max_uses"] == 2


def test_audit_and_report_show_the_replay_share_and_ages(tmp_path, cli):
    """`rollstore audit --format json` has a `replay` view (origin × age) and `rollstore report` a
    replay section with the share and the ages of the selected rows per curation."""
    from rollstore.builtin.synthetic import rollouts_table

    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        for step in range(3):
            buf.append_rollouts(rollouts_table(n_groups=6, group_size=4, step=step, policy_version=step, seed=step))
        result = curate(buf, load_recipe("replay-rollouts"), {})
    selected = [r for r in result.audit.to_pylist() if r["selected"]]
    replayed = [r for r in selected if r["replayed"]]
    assert replayed, "the window had rows with |A| > 0"
    res = cli("audit", root, result.curation_id, "--format", "json")
    assert res.code == 0, res.stderr
    view = {(r["origin"], r["age"]): r for r in json.loads(res.stdout)["replay"]}
    assert view[("fresh", 0)]["selected"] == len(selected) - len(replayed)
    assert sum(r["selected"] for k, r in view.items() if k[0] == "replayed") == len(replayed)
    assert {k[1] for k in view if k[0] == "replayed"} <= {1, 2}
    assert sum(r["share_of_selected"] for r in view.values()) == pytest.approx(1.0, abs=0.01)
    out = tmp_path / "report.html"
    res = cli("report", root, "--out", str(out))
    assert res.code == 0, res.stderr
    html = out.read_text()
    share = round(len(replayed) / len(selected), 3)
    assert 'id="replay"' in html and f"{share:g}" in html and "replay-rollouts" in html


def test_a_replay_curation_killed_at_every_write_point_counts_no_use_twice(tmp_path, cli):
    """kill -9 of `rollstore curate --recipe replay-rollouts` after each storage write or manifest
    call: nothing is committed, so no use is counted; the rerun commits once, and a later replay
    curation sees each rollout used exactly as often as committed curations selected it."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import ROOT
    from rollstore.builtin.synthetic import rollouts_table
    from test_integrity import CURATE_ZYGOTE

    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        for step in range(3):
            buf.append_rollouts(rollouts_table(n_groups=6, group_size=4, step=step, policy_version=step, seed=5))
    args = ["--recipe", "replay-rollouts", "--set", "where=step = 2"]
    script = CURATE_ZYGOTE.format(root=ROOT, buffer=root).replace(
        '"--recipe", "d3s", "--set", "where=true"', ", ".join(repr(a) for a in args))
    assert script != CURATE_ZYGOTE.format(root=ROOT, buffer=root)
    zygote = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert zygote.stdout.readline().strip() == "ready"
    try:
        for n in range(1, 200):
            with Buffer.open(root) as buf:
                seq = buf.manifest.latest_seq()
            zygote.stdin.write(f"{n} {seq}\n")
            zygote.stdin.flush()
            status = int(zygote.stdout.readline())
            if os.WIFEXITED(status):
                assert os.WEXITSTATUS(status) == 0
                break
            assert os.WTERMSIG(status) == signal.SIGKILL
            with Buffer.open(root) as buf:
                assert buf.manifest.latest_seq() == seq, f"kill point {n} committed something"
            res = cli("sql", root, "SELECT count(*) AS n FROM curations", "--format", "json")
            assert json.loads(res.stdout) == [{"n": 0}], f"kill point {n} left a curation"
        else:
            pytest.fail("the curation never ran to its end")
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
    assert n > 5
    res = cli("sql", root, "SELECT count(*) AS n, count(DISTINCT rollout_id) AS d FROM selections WHERE selected "
                           "AND curation_id IN (SELECT curation_id FROM curations)", "--format", "json")
    (counts,) = json.loads(res.stdout)
    assert counts["n"] == counts["d"] > 0  # one committed curation: every selected row used once
    with Buffer.open(root) as buf:
        again = curate(buf, load_recipe("replay-window"), {"where": "step = 2", "replay_window": "2"})
    first = {r["rollout_id"] for r in json.loads(cli("sql", root, "SELECT rollout_id FROM selections WHERE selected "
                                                     f"AND curation_id <> '{again.curation_id}'",
                                                     "--format", "json").stdout)}
    seen = {r["rollout_id"]: r["uses"] for r in again.audit.to_pylist()}
    assert all(seen[rid] == 1 for rid in first if rid in seen) and all(
        u == 0 for rid, u in seen.items() if rid not in first)


def test_replay_refuses_rows_without_behaviour_log_probs():
    """A window row whose only log-probs were recomputed at import by a score model cannot be
    replayed (its behaviour policy is unknown): one line naming the row; fresh-only curation works."""
    meta = json.dumps({"import": {"format": "verl-jsonl", "lossy": ["gen_logprobs recomputed by teacher forcing with m"]}})
    rows = [_row("run", 0, 0, 0, i, i % 2 == 0, float(i % 2 == 0), 2, 0) for i in range(4)]
    rows += [_row("run", 1, 1, 0, i, i % 2 == 0, float(i % 2 == 0), 2, 0) for i in range(4)]
    for r in rows[:4]:
        r["old_logprobs"], r["meta"] = None, meta
    with _buffer(rows) as buf:
        seq = buf.manifest.latest_seq()
        with pytest.raises(CurationError, match=r"rollout_id='run-s0g0a0': column 'old_logprobs' is null and "
                                                r"'gen_logprobs' were recomputed at import"):
            curate(buf, load_recipe("replay-window"), {"where": "step = 1"})
        assert buf.manifest.latest_seq() == seq
        assert curate(buf, load_recipe("grpo"), {"where": "step = 1"}).record["n_selected"] == 4


def test_uses_read_only_the_audits_that_meet_the_batch_and_count_them_all(tmp_path, monkeypatch):
    """The uses step reads the committed audits whose rollout_id range (footer statistics) meets the
    batch's, and is skipped when none does: a new step's batch reads no audit of the steps before it,
    yet a batch spanning every step counts every use (checked against a count over `selections`)."""
    from rollstore.builtin.synthetic import RowOptions, rollouts_table

    from rollstore.curate import steps as steps_mod
    from rollstore.queries.session import Session

    read: list[tuple[str, ...]] = []
    relation = steps_mod.Audits.relation

    def spy(self, session):
        got = relation(self, session)
        read.append(tuple(p for p in self.paths if got is not None and p in got))
        return got

    monkeypatch.setattr(steps_mod.Audits, "relation", spy)
    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        for step in range(3):
            buf.append_rollouts(rollouts_table(n_groups=4, group_size=4, mean_tokens=5, step=step,
                                               options=RowOptions(id_prefix=f"s{step}")))
            read.clear()
            cur = curate(buf, load_recipe("grpo"), {"where": f"step = {step}"})
            assert read == [()], read  # the audits of steps before it do not meet this step's rows
            assert all(r["uses"] == 0 for r in cur.audit.to_pylist())
        read.clear()
        again = curate(buf, load_recipe("grpo"), {"where": "step <= 1", "max_reuse": "1"})
        assert len(read) == 1 and len(read[0]) == 2, read  # steps 0 and 1's audits, not step 2's
        with buf.snapshot() as snap, Session(snap) as s:
            before = dict(s.execute("SELECT rollout_id, count(DISTINCT curation_id) FROM selections "
                                    "WHERE selected AND curation_id <> $c GROUP BY ALL",
                                    {"c": again.curation_id}).fetchall())
        audit = again.audit.to_pylist()
        assert sum(before.values()) > 0
        assert {r["rollout_id"]: r["uses"] for r in audit} == {r["rollout_id"]: before.get(r["rollout_id"], 0)
                                                                for r in audit}
        assert all((r["reason"] == "reused") == (before.get(r["rollout_id"], 0) >= 1 and r["reason"] != "invalid")
                   for r in audit if r["reason"] not in ("truncated", "stale"))


def test_string_range_reads_arrow_statistics_and_gives_up_on_anything_else(tmp_path):
    """The range of a string column from the footer: exact for Arrow's writer; None (any value) without
    statistics, with nulls, or from another writer (which may truncate string statistics)."""
    import duckdb
    import pyarrow as pa

    from rollstore.storage.snapshot import string_range

    t = pa.table({"rollout_id": ["b", "a", "d", "c"]})
    pq.write_table(t, tmp_path / "a.parquet", row_group_size=2)
    assert string_range(str(tmp_path / "a.parquet"), "rollout_id") == ("a", "d")
    pq.write_table(t, tmp_path / "n.parquet", write_statistics=False)
    assert string_range(str(tmp_path / "n.parquet"), "rollout_id") is None
    pq.write_table(pa.table({"rollout_id": ["a", None]}), tmp_path / "z.parquet")
    assert string_range(str(tmp_path / "z.parquet"), "rollout_id") is None
    duckdb.sql(f"COPY (SELECT 'a' AS rollout_id) TO '{tmp_path / 'd.parquet'}' (FORMAT parquet)")
    assert string_range(str(tmp_path / "d.parquet"), "rollout_id") is None
    assert string_range(str(tmp_path / "a.parquet"), "other") is None
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")  # unreadable: any value, no traceback
    assert string_range(str(tmp_path / "bad.parquet"), "rollout_id") is None
    assert string_range(str(tmp_path / "gone.parquet"), "rollout_id") is None
