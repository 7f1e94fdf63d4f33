"""Pre-rollout prompt selection's kept state (issue 49, `storage.prompt_state`): the catalog keeps each
prompt's groups and each run's newest selection as rows are committed; greso's state and history read
from it equal the plan's queries over the whole history, on hypothesis-generated histories (selections
as the loop makes them, rewards of every kind, several groups a step, interleaved runs, groups
committed out of order, compaction and quarantine); on SQLite and PostgreSQL."""

from __future__ import annotations

import itertools
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollstore.builtin.synthetic import RowOptions, rollouts_table
from rollstore.curate import prompts
from rollstore.curate.params import load_recipe, resolve
from rollstore.curate.prompts import prompt_plan, select
from rollstore.queries.session import Session
from rollstore.storage.buffer import Buffer
from rollstore.storage.maintenance import compact

POOL = 6
PLAN = prompt_plan(resolve(load_recipe("d3s"), {"prompt_skip": "greso", "skip_window": 3}))
_ids = itertools.count()


def _groups(run: str, step: int, prompt_ids: list[str], rewards: list[list[int]]) -> pa.Table:
    """One group per prompt, its rows' rewards (1 correct, 0 wrong, 2: a reward of 0.5 and `correct` null)."""
    size = len(rewards[0])
    t = rollouts_table(n_groups=len(prompt_ids), group_size=size, mean_tokens=4, seed=step, run_id=run, step=step,
                       options=RowOptions(id_prefix=f"{run}-{next(_ids)}"))
    flat = [r for g in rewards for r in g]
    t = t.set_column(t.schema.get_field_index("prompt_id"), "prompt_id",
                     pa.array([p for p in prompt_ids for _ in range(size)]))
    t = t.set_column(t.schema.get_field_index("reward"), "reward",
                     pa.array(np.array([0.5 if r == 2 else float(r) for r in flat], np.float32)))
    return t.set_column(t.schema.get_field_index("correct"), "correct",
                        pa.array([None if r == 2 else bool(r) for r in flat], pa.bool_()))


def _both(session: Session, run: str, step: int):
    """(kept state, kept history) and (the plan's queries' state and history) at `step`."""
    ids = [f"p{i}" for i in range(POOL)]
    kept = (prompts._kept_state(session, run, step, PLAN), prompts._kept_history(session, run, step, ids, PLAN))
    with mock.patch.object(prompts, "_kept_state", return_value=None), \
            mock.patch.object(prompts, "_kept_history", return_value=None):
        full = (prompts.state(session, run, step, PLAN), prompts.history(session, run, step, ids, PLAN))
    return kept, full


def _check(session: Session, run: str, step: int, must_answer: bool) -> None:
    (k_state, k_hist), (f_state, f_hist) = _both(session, run, step)
    if must_answer:
        assert k_state is not None and k_hist is not None
    if k_state is not None:
        assert k_state == f_state
    if k_hist is not None:
        assert k_hist == f_hist


step_plan = st.lists(st.tuples(
    st.integers(1, 4),  # prompts generated this step
    st.lists(st.lists(st.sampled_from([0, 1, 2]), min_size=2, max_size=2), min_size=4, max_size=4),  # rewards
    st.sampled_from(["none", "second run", "old group", "compact", "quarantine"])),  # what else happens
    min_size=1, max_size=6)


def _run_history(buf: Buffer, steps) -> None:
    run = "r"
    session = Session(buf.snapshot(), threads=1)
    position, ordered = 0, True
    try:
        for s, (need, rewards, extra) in enumerate(steps):
            session.rebind(buf.snapshot())
            _check(session, run, s, must_answer=ordered and s > 0)
            now = prompts.state(session, run, s, PLAN)
            start = position if now.last_position is None else now.last_position + 1
            sel = select(session, PLAN, run_id=run, step=s, seed=3, stream=lambda pos: _Prompt(f"p{pos % POOL}"),
                         start=start, need=need, limit=POOL, rates=now.rates)
            chosen = [c.prompt_id for c in sel.chosen]
            buf.append_rollouts(_groups(run, s, chosen, rewards[:len(chosen)]), source=f"s{s}",
                                also={"prompt_selections": sel.table()})
            if extra == "second run":  # another run's groups of the same prompts: not this run's history
                buf.append_rollouts(_groups("other", s, chosen, rewards[:len(chosen)]), source=f"o{s}")
            elif extra == "old group" and s > 0:  # a group of an earlier step committed now: out of order
                buf.append_rollouts(_groups(run, s - 1, ["p0"], rewards[:1]), source=f"late{s}")
                ordered = False
            elif extra == "compact":
                compact(buf, "rollouts")
                compact(buf, "prompt_selections")
            elif extra == "quarantine" and s > 1:
                from rollstore.storage.verify import retire

                first = buf.manifest.shards("rollouts")[0]
                retire(buf.manifest, [first], "quarantine")
                ordered = False
            session.rebind(buf.snapshot())
            for asked in (s, s + 1, s + 2):  # a resumed step (its selection recorded), the next, a later one
                _check(session, run, asked, must_answer=ordered and asked > s)
    finally:
        session.close()


class _Prompt:
    def __init__(self, prompt_id: str):
        self.prompt_id, self.prompt = prompt_id, f"prompt {prompt_id}"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=step_plan)
def test_kept_state_equals_the_plans_queries(tmp_path_factory, steps):
    with Buffer.init(str(tmp_path_factory.mktemp("buf") / "b")) as buf:
        _run_history(buf, steps)


def test_kept_state_on_postgresql(tmp_path, pg):
    steps = [(2, [[1, 1], [0, 0], [1, 0], [2, 2]], "none"), (3, [[1, 1], [0, 0], [1, 1], [0, 0]], "second run"),
             (2, [[0, 0], [0, 0], [1, 1], [1, 1]], "compact"), (2, [[1, 1], [1, 1], [0, 1], [1, 1]], "none")]
    with Buffer.init(str(tmp_path / "buf"), catalog=pg.fresh_dsn()) as buf:
        _run_history(buf, steps)
        assert buf.manifest.prompt_state("r", ["p0"]) is not None


def test_a_buffer_written_before_the_state_is_read_from_its_shards(buffer_dir):
    """A run whose earlier rows were committed without the state is never kept: the queries answer."""
    with Buffer.open(buffer_dir) as buf:
        buf.append_rollouts(_groups("r", 0, ["p0", "p1"], [[1, 1], [0, 0]]), source="old")
        with buf.manifest.transaction() as con:  # as a rollstore without the state left it
            con.execute("DROP TABLE prompt_state")
            con.execute("DROP TABLE prompt_state_runs")
        buf.append_rollouts(_groups("r", 1, ["p0"], [[1, 1]]), source="new")
        assert buf.manifest.prompt_state("r", ["p0"]) is None
        with Session(buf.snapshot(), threads=1) as session:
            (k_state, k_hist), (_f_state, f_hist) = _both(session, "r", 2)
            assert k_state is None and k_hist is None and f_hist["p0"] == (2, 2, "all_correct")
        buf.append_rollouts(_groups("new-run", 0, ["p0"], [[0, 0]]), source="fresh")
        assert buf.manifest.prompt_state("new-run", ["p0"])[1]["p0"][:2] == (1, 1)


@pytest.mark.parametrize("window", [1, 2, 8])
def test_the_window_is_applied_when_read(buffer_dir, window):
    plan = prompt_plan(resolve(load_recipe("d3s"), {"prompt_skip": "greso", "skip_window": window}))
    with Buffer.open(buffer_dir) as buf:
        for s, r in enumerate([[0, 1], [1, 1], [1, 1], [1, 1]]):
            buf.append_rollouts(_groups("r", s, ["p0"], [r]), source=f"s{s}")
        with Session(buf.snapshot(), threads=1) as session:
            kept = prompts._kept_history(session, "r", 4, ["p0"], plan)
            assert kept == {"p0": (min(4, window), min(3, window), "all_correct")}
