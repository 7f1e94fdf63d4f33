"""A snapshot's table stamps (`Snapshot.table_keys`, `Catalog.table_stamp`): what a session compares on
a rebind to know which views to make again, without listing any shard (issue 49). Two snapshots whose
stamps for a table are equal must list the same shards of it, whatever happened between them —
appends, curations, compaction, and gc deleting the rows of retired shards — and a session rebound
across those reads what a new session reads."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollstore.builtin.synthetic import rollouts_table
from rollstore.curate.params import load_recipe, step_where
from rollstore.curate.run import curate
from rollstore.queries.session import Session
from rollstore.storage.buffer import Buffer
from rollstore.storage.maintenance import compact, gc
from rollstore.storage.schema import TABLES

RECIPE = load_recipe("d3s")


def _do(buf: Buffer, op: str, step: int) -> int:
    if op == "append":
        buf.append_rollouts(rollouts_table(n_groups=2, group_size=4, mean_tokens=6, seed=step, run_id="r", step=step,
                                           n_prompts=2), source=f"s{step}")
        return step + 1
    if op == "curate" and step:
        curate(buf, RECIPE, {"where": step_where("r", step - 1), "progress": f"{step / 10:.2f}"})
    elif op == "compact":
        for table in ("rollouts", "selections"):
            compact(buf, table, target_bytes=1 << 40)
    elif op == "gc":
        gc(buf, 0)
    return step


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.sampled_from(["append", "append", "curate", "compact", "gc"]), min_size=2, max_size=9))
def test_equal_stamps_list_equal_shards_and_a_rebound_session_reads_as_a_new_one(tmp_path_factory, ops):
    root = str(tmp_path_factory.mktemp("stamps"))
    with Buffer.init(root) as buf:
        seen: list[tuple[dict, dict]] = []
        step = 0
        with Session(buf.snapshot(), threads=1) as session:
            for op in ops:
                step = _do(buf, op, step)
                with buf.snapshot() as snap:
                    keys = snap.table_keys()
                    lists = {t: [s.path for s in snap.shards(t)] for t in TABLES}
                    lists["curated"] = (lists["curated"], lists["rollouts"])
                    for old_keys, old_lists in seen:
                        for t in TABLES:
                            if old_keys[t] == keys[t]:
                                assert old_lists[t] == lists[t], (op, t)
                    seen.append((keys, lists))
                    session.rebind(snap)
                    with Session(snap, threads=1) as fresh:
                        for t in TABLES:
                            ids = "sum(hash(rollout_id))" if t in ("rollouts", "curated", "selections") else "0"
                            q = f"SELECT count(*), {ids} FROM {t}"
                            assert session.con.execute(q).fetchall() == fresh.con.execute(q).fetchall(), (op, t)
