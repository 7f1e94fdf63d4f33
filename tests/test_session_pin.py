"""A loop's DuckDB session, kept between steps, pins its snapshot (issue 49): `compact` then `gc` while a
loop runs removed the files its session's views read, and the loop's next greso step failed with
FileNotFoundError. Now the retired files stay until the session moves on, then gc takes them."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from rollstore.builtin.synthetic import RowOptions, rollouts_table
from rollstore.curate.params import load_recipe, resolve, step_where
from rollstore.curate.prompts import prompt_plan, select, state
from rollstore.curate.run import curate
from rollstore.queries.session import Session
from rollstore.storage.buffer import Buffer
from rollstore.storage.maintenance import compact, gc

SETS = {"prompt_skip": "greso"}


class _Prompt:
    def __init__(self, pos: int):
        self.prompt_id, self.prompt = f"p{pos % 12}", f"prompt {pos % 12}"


def _step(buf: Buffer, session: Session, plan, s: int, position: int) -> int:
    """One loop step as the loop does it: greso on the kept session, append, curate through the session."""
    now = state(session, "run", s, plan)
    start = position if now.last_position is None else now.last_position + 1
    sel = select(session, plan, run_id="run", step=s, seed=0, stream=_Prompt, start=start, need=3, limit=12,
                 rates=now.rates)
    ids = [c.prompt_id for c in sel.chosen]
    t = rollouts_table(n_groups=len(ids), group_size=4, mean_tokens=6, seed=s, run_id="run", step=s,
                       options=RowOptions(id_prefix=f"run-{s}"))
    t = t.set_column(t.schema.get_field_index("prompt_id"), "prompt_id", pa.array([p for p in ids for _ in range(4)]))
    buf.append_rollouts(t, source=f"s{s}", also={"prompt_selections": sel.table()})
    curate(buf, load_recipe("d3s"), {**SETS, "where": step_where("run", s)}, session=session)
    return sel.next_position


def test_compact_and_gc_while_a_loop_runs_leave_its_session_readable(buffer_dir):
    with Buffer.open(buffer_dir) as buf:
        plan = prompt_plan(resolve(load_recipe("d3s"), SETS))
        session = Session(buf.snapshot(), threads=1)
        position = 0
        for s in range(4):
            position = _step(buf, session, plan, s, position)
        old = [os.path.join(buf.root, sh.path) for sh in buf.manifest.shards("rollouts")]
        assert compact(buf, "rollouts").merged_shards == 4
        gc(buf, 0)
        assert all(os.path.exists(p) for p in old)  # the session's snapshot still reads them
        for s in range(4, 6):  # the next greso steps (and curations) run as before
            position = _step(buf, session, plan, s, position)
        gc(buf, 0)  # the session moved on: its old snapshot's retired files go
        assert not any(os.path.exists(p) for p in old)
        session.close()
        assert buf.manifest.oldest_pinned_seq() is None


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_sessions_pin_keeps_shards_not_pruned_checkpoints(tmp_path, request, kind):
    """Its pin is one of shards only (`Manifest.pin_shards`): gc keeps the retired shards it reads, while
    retention removes pruned checkpoint folders at once, as without it (a session loads no weights)."""
    catalog = request.getfixturevalue("pg").fresh_dsn() if kind == "postgres" else None
    with Buffer.init(str(tmp_path / "buf"), catalog=catalog) as buf:
        buf.append_rollouts(rollouts_table(n_groups=2, group_size=2, mean_tokens=4), source="s")
        seq = buf.manifest.latest_seq()
        with Session(buf.snapshot(), threads=1) as session:
            assert buf.manifest.oldest_pinned_seq() == seq  # gc's retired shards wait for it
            assert buf.manifest.oldest_checkpoint_pin() is None  # pruned checkpoints' folders do not
            with buf.snapshot(pin=True) as snap:  # an ordinary pin holds both
                assert buf.manifest.oldest_checkpoint_pin() == snap.seq
            session.rebind(buf.snapshot())
            assert buf.manifest.oldest_pinned_seq() == seq  # one pin, moved with the session
        assert buf.manifest.oldest_pinned_seq() is None
