"""The cross-group selection kernel (`curate/selection.py`, kernel step max_variance) against the
SQL it replaces for one pool (`queries/curate_select.sql` with the batch as the pool): the same
`picked` rows (selected, sample_rank) for pools with ties made on purpose (few distinct values,
binary rewards, equal advantages), reasons that leave rows out, and every sample fraction."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import duckdb
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstore.curate import kernels
from rollstore.curate.plan import Step
from rollstore.queries import render


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, f32(0.1), f32(-1 / 3), f32(2.7182817), 3.0, -3.0])


@st.composite
def pools(draw):
    n = draw(st.integers(0, 40))
    ids = draw(st.lists(st.text("abAB0é", min_size=1, max_size=4), min_size=n, max_size=n, unique=True))
    binary = draw(st.booleans())
    rows = [{"rollout_id": rid,
             "reason": draw(st.sampled_from([None, None, None, "invalid", "stale"])),
             "advantage_final": (draw(st.sampled_from([1.0, -1.0])) if binary else draw(VALUES))} for rid in ids]
    f_den = draw(st.integers(1, 9))
    return rows, draw(st.integers(0, f_den)), f_den


def _work(rows: list[dict]) -> pa.Table:
    return pa.table({"rollout_id": pa.array([r["rollout_id"] for r in rows], pa.string()),
                     "reason": pa.array([r["reason"] for r in rows], pa.string()),
                     "advantage_final": pa.array([r["advantage_final"] for r in rows], pa.float32())})


@settings(max_examples=120, deadline=None)
@given(pools())
def test_the_kernel_picks_what_the_sql_picks(pool):
    rows, f_num, f_den = pool
    con = duckdb.connect()
    con.register("_w", _work(rows))
    con.execute("CREATE TEMP TABLE work AS SELECT * FROM _w")
    values = {"f_num": f_num, "f_den": f_den}
    con.execute(render("curate_select", {"pool_key": "'batch'", "value": "advantage_final"}), values)
    want = con.execute("SELECT rollout_id, selected, sample_rank FROM picked ORDER BY rollout_id").fetchall()
    step = Step("max_variance", "select", "global", (), (), kernel="max_variance",
                args=(("value", "advantage_final"),))
    got = kernels.run_session(step, SimpleNamespace(con=con, relation=con.table), values, {})
    assert [tuple(r.values()) for r in got.to_pylist()] == want
