"""The token threshold and the kept counts as kernels (numpy over the decoded entropies) against
DuckDB's own order of the SQL score `abs(advantage_final::DOUBLE) * h::DOUBLE` (or `h::DOUBLE`):
the same K-th token (score, rollout_id, position), the same kept count per row, with ties made on
purpose (few values, products rounded to float64, -0, zero advantages) and any split of the rows
into shards (the merges on the client) or into decoded chunks."""

from __future__ import annotations

import os
import struct
import tempfile
import uuid
from types import SimpleNamespace

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstore.curate import entropies, kernels
from rollstore.curate import tokens as tokens_mod
from rollstore.curate.merges import MERGES
from rollstore.curate.plan import Step
from rollstore.curate.tokens import kept_expression, score_expression


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# Few values (ties across rows and positions), some whose products round in float64.
ENTROPIES = st.sampled_from([0.0, -0.0, 0.25, 0.5, 1.0, 1.5, 3.0, f32(0.1), f32(0.3), f32(1 / 3), f32(2.7182817)])
ADVANTAGES = st.sampled_from([0.0, -0.0, -1.5, 0.5, 1.0, 2.0, f32(0.3), -f32(1 / 3), f32(3.0000002)])


@st.composite
def batches(draw):
    n = draw(st.integers(0, 8))
    ids = draw(st.lists(st.text("abAB0é", min_size=1, max_size=3), min_size=n, max_size=n, unique=True))
    rows = [{"rollout_id": rid, "advantage_final": draw(ADVANTAGES),
             "entropies": draw(st.lists(ENTROPIES, max_size=7))} for rid in ids]
    token = draw(st.sampled_from(["entropy", "abs_adv_entropy"]))
    total = sum(len(r["entropies"]) for r in rows)
    k = draw(st.integers(0, total))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
    return rows, token, k, cuts, draw(st.integers(1, 4))


_SHARDS = tempfile.TemporaryDirectory(prefix="rs-token-kernels-")  # removed when the module goes


def _session(rows: list[dict]) -> SimpleNamespace:
    """A session holding `selected_rows` (the kernels' input: each row's shard and position) over a
    Parquet file holding the rows' entropies in reverse order among rows that are not selected, and
    `selected_entropies` (the brute force's input)."""
    con = duckdb.connect()
    entropies = pa.array([r["entropies"] for r in rows], pa.list_(pa.float32()))
    con.register("_in", pa.table({
        "rollout_id": pa.array([r["rollout_id"] for r in rows], pa.string()),
        "advantage_final": pa.array([r["advantage_final"] for r in rows], pa.float64()),
        "entropies": entropies,
    }))
    con.execute("CREATE TEMP TABLE selected_entropies AS SELECT * FROM _in")
    path = os.path.join(_SHARDS.name, f"shard-{uuid.uuid4().hex}.parquet")
    n = len(rows)
    stored = [[9.0, 9.0]] + [r["entropies"] for r in reversed(rows)] + [None]  # row 0, the last: not selected
    pq.write_table(pa.table({"entropies": pa.array(stored, pa.list_(pa.float32()))}), path, row_group_size=3)
    con.register("_sel", pa.table({
        "rollout_id": pa.array([r["rollout_id"] for r in rows], pa.string()),
        "advantage_final": pa.array([r["advantage_final"] for r in rows], pa.float64()),
        "filename": pa.array([path] * n, pa.string()),
        "rollouts_row": pa.array([n - i for i in range(n)], pa.int64()),
    }))
    con.execute("CREATE TEMP TABLE selected_rows AS SELECT * FROM _sel")
    return SimpleNamespace(con=con, relation=con.table, spill_dir=os.path.join(_SHARDS.name, f"spill-{uuid.uuid4().hex}"))


def _step(name: str, token: str) -> Step:
    return Step(name, "tokens", "global", (), (), kernel=name, args=(("token", token),))


def _brute(rows: list[dict], token: str, k: int):
    """The K-th token and the kept counts, from DuckDB's sort of the SQL score."""
    con = _session(rows).con
    order = con.execute(f"""
        WITH t AS (SELECT rollout_id, advantage_final, unnest(entropies) AS h,
                          unnest(range(1, len(entropies) + 1)) AS pos FROM selected_entropies)
        SELECT ({score_expression(token)})::DOUBLE AS score, rollout_id, pos FROM t
        ORDER BY score DESC, rollout_id ASC, pos ASC""").fetchall()
    values = tokens_mod.mask_values(None if k == 0 else (order[k - 1][0], order[k - 1][1], order[k - 1][2]))
    counts = dict(con.execute(f"SELECT e.rollout_id, ({kept_expression(token)})::INTEGER FROM selected_entropies e",
                              values).fetchall())
    kept = {}
    for _, rid, _ in order[:k]:
        kept[rid] = kept.get(rid, 0) + 1
    assert counts == {r["rollout_id"]: kept.get(r["rollout_id"], 0) for r in rows}  # the SQL predicate's proof
    return values, counts


@settings(max_examples=60, deadline=None)  # 200 take ~18 s: the suite's budget
@given(batches())
def test_kernels_find_the_sql_threshold_and_kept_counts_across_shards_and_chunks(batch):
    rows, token, k, cuts, chunk_rows = batch
    want, want_counts = _brute(rows, token, k)
    parts = [rows[a:b] for a, b in zip([0, *cuts], [*cuts, len(rows)])]
    sessions = [_session(p) for p in parts if p]
    saved = entropies.SCORED_ROWS
    entropies.SCORED_ROWS = chunk_rows
    try:
        values = {"token_budget": k}
        caches = [{} for _ in sessions]
        hist = [[tuple(r.values()) for r in kernels.run_session(_step("token_histogram", token), s, values, c)
                 .to_pylist()] for s, c in zip(sessions, caches)]
        values.update(MERGES["histogram"].combine(hist, values))
        if MERGES["heads"].runs(values):
            heads = [kernels.run_session(_step("token_heads", token), s, values, c) for s, c in zip(sessions, caches)]
            values.update(MERGES["heads"].combine(heads, values))
        got = {key: values[key] for key in ("thr", "thr_rollout", "thr_pos")}
        assert got == want
        if k:  # the same float64: a tie at the threshold is the same tie
            assert struct.pack("d", got["thr"]) == struct.pack("d", want["thr"]) or got["thr"] == 0.0
        counts = {}
        for s, c in zip(sessions, caches):
            table = kernels.run_session(_step("tokens_kept", token), s, values, c)
            counts.update(zip(table.column("rollout_id").to_pylist(), table.column("tokens_kept").to_pylist()))
        assert counts == want_counts
        assert sum(counts.values()) == k
    finally:
        entropies.SCORED_ROWS = saved


def test_past_the_cache_size_the_passes_read_a_spill_file_with_the_same_result(monkeypatch):
    """Past SCORED_CACHE_TOKENS the selected rows' entropies are read from the shards once more into an Arrow
    file in the session's spill folder, which every pass then reads (not the shards); `release` removes it."""
    rows = [{"rollout_id": f"r{i}", "advantage_final": [0.5, -1.0, 2.0][i % 3],
             "entropies": [f32(0.1 * j) for j in range(i % 5 + 1)]} for i in range(30)]
    want, want_counts = _brute(rows, "abs_adv_entropy", 17)
    monkeypatch.setattr(entropies, "SCORED_ROWS", 4)
    monkeypatch.setattr(entropies, "SCORED_CACHE_TOKENS", 10)
    reads = []
    real = entropies.column_at
    monkeypatch.setattr(entropies, "column_at", lambda *a, **k: (reads.append(a[0]), real(*a, **k))[1])
    s, cache, values = _session(rows), {}, {"token_budget": 17}
    hist = [tuple(r.values()) for r in kernels.run_session(_step("token_histogram", "abs_adv_entropy"), s, values,
                                                            cache).to_pylist()]
    values.update(MERGES["histogram"].combine([hist], values))
    values.update(MERGES["heads"].combine([kernels.run_session(_step("token_heads", "abs_adv_entropy"), s, values,
                                                                cache)], values))
    (spilled,) = cache.values()
    assert isinstance(spilled, str) and os.path.exists(spilled) and spilled.startswith(s.spill_dir)
    assert {key: values[key] for key in ("thr", "thr_rollout", "thr_pos")} == want
    table = kernels.run_session(_step("tokens_kept", "abs_adv_entropy"), s, values, cache)
    assert dict(zip(table.column("rollout_id").to_pylist(), table.column("tokens_kept").to_pylist())) == want_counts
    assert len(reads) == 2  # the first pass up to the cache size, then the spill: never once per pass
    entropies.release(cache)
    assert cache == {} and not os.path.exists(spilled)


def test_a_kernel_returning_another_shape_stops_with_one_line(monkeypatch):
    s = _session([{"rollout_id": "a", "advantage_final": 1.0, "entropies": [1.0]}])
    bad = kernels.Kernel("token_histogram", "1", lambda chunks, values, args: pa.table({"bucket": [1]}),
                         kernels.KERNELS["token_histogram"].reads, kernels.KERNELS["token_histogram"].adds,
                         source="selected_rows")
    monkeypatch.setitem(kernels.KERNELS, "token_histogram", bad)
    with pytest.raises(kernels.CurationError, match="kernel step token_histogram .*declared"):
        kernels.run_session(_step("token_histogram", "entropy"), s, {"token_budget": 1}, {})


def test_the_input_check_names_the_first_row_without_finite_entropies_and_its_shard():
    """`missing_entropies`: the first selected row by rollout_id whose entropies are null (missing)
    or hold a NaN or an infinity, with its input shard (the merge `first_missing` raises it)."""
    rows = [{"rollout_id": "c", "advantage_final": 1.0, "entropies": [0.5, float("nan")]},
            {"rollout_id": "d", "advantage_final": 1.0, "entropies": None},
            {"rollout_id": "b", "advantage_final": 1.0, "entropies": [float("inf")]},
            {"rollout_id": "a", "advantage_final": 1.0, "entropies": [0.5, 1.0]}]
    s = _session(rows)
    path = s.con.execute("SELECT any_value(filename) FROM selected_rows").fetchall()[0][0]
    got = kernels.run_session(_step("missing_entropies", "abs_adv_entropy"), s, {}, {}).to_pylist()
    assert got == [{"rollout_id": "b", "missing": False, "filename": path}]
    got = kernels.run_session(_step("missing_entropies", "entropy"), _session(rows[1:2] + rows[3:]), {}, {})
    assert [(r["rollout_id"], r["missing"]) for r in got.to_pylist()] == [("d", True)]
    clean = kernels.run_session(_step("missing_entropies", "entropy"), _session(rows[3:]), {}, {})
    assert clean.num_rows == 0
    with pytest.raises(kernels.CurationError, match=r"^rollout_id='d': column 'entropies' is null, but token=entropy"):
        MERGES["first_missing"].combine([[tuple(r.values()) for r in got.to_pylist()]], {"token_mode": "entropy"})


def test_a_spilled_curation_materialises_from_its_spill_file_with_the_same_rows(tmp_path, monkeypatch):
    """A real d3s curation whose selected tokens pass the cache size: the token stage spills, the
    materialisation takes the rows' entropies from the spill file (no shard read for them), the curated rows
    equal a run that did not spill, and the file is gone when the curation returns."""
    from rollstore.builtin.synthetic import rollouts_table
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.storage.buffer import Buffer

    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        for step in range(3):
            buf.append_rollouts(rollouts_table(n_groups=6, group_size=4, step=step, seed=step), f"s{step}")

    def run():
        with Buffer.open(root) as buf:
            return curate(buf, load_recipe("d3s"), {"where": "true", "progress": "0"}, commit=False)

    plain = run()
    reads = []
    real = entropies.column_at
    monkeypatch.setattr(entropies, "column_at", lambda *a, **k: (reads.append(a[3]), real(*a, **k))[1])
    monkeypatch.setattr(entropies, "SCORED_CACHE_TOKENS", 50)
    spills = []
    real_spill = entropies.spill
    monkeypatch.setattr(entropies, "spill", lambda *a, **k: (spills.append(real_spill(*a, **k)), spills[-1])[1])
    spilled = run()
    assert len(spills) == 1 and not os.path.exists(spills[0]) and entropies._spills == {}
    assert reads and "the curation's materialisation" not in reads, reads
    assert spilled.curated.equals(plain.curated)
    assert {k: v for k, v in spilled.record.items() if k != "created_at"} == \
        {k: v for k, v in plain.record.items() if k != "created_at"}
