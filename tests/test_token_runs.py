"""The loss mask a curation writes (kept runs, numpy) against the brute-force order of
docs/curation.md §Token selection, and against the SQL count the audit records (tokens_kept)."""

from __future__ import annotations

import os

import duckdb
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstore.curate import tokens as tokens_mod
from rollstore.curate.params import CurationError
from rollstore.curate.tokens import check_kept, keep_runs, kept_expression, mask_values, run_lengths
from rollstore.storage.references import runs_to_mask

ENTROPIES = st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 3.0])  # few values: ties across rows and positions


@st.composite
def batches(draw):
    n = draw(st.integers(0, 6))
    ids = draw(st.lists(st.text("abc", min_size=1, max_size=3), min_size=n, max_size=n, unique=True))
    rows = [{"rollout_id": rid,
             "advantage": draw(st.sampled_from([0.0, -1.5, 0.5, 1.0, 2.0])),
             "entropies": draw(st.lists(ENTROPIES, max_size=6))} for rid in ids]
    token = draw(st.sampled_from(["entropy", "abs_adv_entropy"]))
    tokens = [(-_score(token, r, h), r["rollout_id"], pos + 1) for r in rows for pos, h in enumerate(r["entropies"])]
    k = draw(st.integers(0, len(tokens)))
    return rows, token, sorted(tokens), k


def _score(token: str, row: dict, h: float) -> float:
    return float(h) if token == "entropy" else abs(float(row["advantage"])) * float(h)


def _table(rows: list[dict]) -> pa.Table:
    return pa.table({
        "rollout_id": pa.array([r["rollout_id"] for r in rows], pa.string()),
        "advantage": pa.array([r["advantage"] for r in rows], pa.float32()),
        "tokens": pa.array([len(r["entropies"]) for r in rows], pa.int32()),
        "entropies": pa.array([r["entropies"] for r in rows], pa.list_(pa.float32())),
    })


@settings(max_examples=150, deadline=None)
@given(batches())
def test_kept_runs_keep_exactly_the_first_k_tokens_in_the_threshold_order(batch):
    rows, token, order, k = batch
    threshold = None if k == 0 else (-order[k - 1][0], order[k - 1][1], order[k - 1][2])
    values = mask_values(threshold)
    kept = {(rid, pos) for _, rid, pos in order[:k]}
    table = _table(rows)
    runs = keep_runs(table, token, values)
    masks = runs_to_mask(runs, table.column("tokens").to_numpy()).to_pylist()
    for row, mask in zip(rows, masks):
        assert mask == [(row["rollout_id"], p + 1) in kept for p in range(len(row["entropies"]))]
    bounds = runs.to_pylist()
    saved, tokens_mod.KEEP_RUNS_CHUNK_TOKENS = tokens_mod.KEEP_RUNS_CHUNK_TOKENS, 3
    try:  # slices of a few tokens each (the size cuts a batch at row boundaries): the same runs
        assert keep_runs(table, token, values).to_pylist() == bounds
    finally:
        tokens_mod.KEEP_RUNS_CHUNK_TOKENS = saved
    assert all(b == sorted(set(b)) and len(b) % 2 == 0 for b in bounds)  # strictly increasing [start, end) pairs

    # The audit's count (SQL, the plan's fragment) agrees with the runs row by row.
    con = duckdb.connect()
    con.register("e_rows", table.rename_columns(["rollout_id", "advantage_final", "tokens_total", "entropies"]))
    by_id = dict(con.execute(f"SELECT e.rollout_id, ({kept_expression(token)})::INTEGER FROM e_rows e",
                             values).fetchall())
    counts = [by_id[r["rollout_id"]] for r in rows]
    assert counts == [int(n) for n in run_lengths(runs)]


def test_without_a_token_stage_every_token_is_one_run():
    table = pa.table({"rollout_id": ["a", "b", "c"], "advantage": pa.array([1.0, 0.0, -2.0], pa.float32()),
                      "tokens": pa.array([3, 0, 1], pa.int32()),
                      "entropies": pa.array([None, None, None], pa.list_(pa.float32()))})
    assert keep_runs(table, "none", {}).to_pylist() == [[0, 3], [], [0, 1]]


def test_masks_that_disagree_with_the_audit_are_refused_and_nothing_is_committed(tmp_path, monkeypatch):
    import pytest

    import rollstore.curate.kernels as kernels
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.storage.buffer import Buffer
    from rollstore.builtin.synthetic import rollouts_table

    runs = pa.array([[0, 2], [1, 3, 4, 5], []], pa.list_(pa.int32()))
    assert list(run_lengths(runs)) == [2, 3, 0]
    check_kept(5, 5)
    real = kernels.keep_runs

    def one_token_short(table, token, values):  # the last kept token of each part dropped
        out = real(table, token, values).to_pylist()
        last = max((i for i, r in enumerate(out) if r), default=None)
        if last is not None:
            out[last] = out[last][:-1] + [out[last][-1] - 1]
        return pa.array(out, pa.list_(pa.int32()))

    monkeypatch.setattr(kernels, "keep_runs", one_token_short)
    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        buf.append_rollouts(rollouts_table(n_groups=6, group_size=4, step=0, seed=3))
        seq = buf.manifest.latest_seq()
        with pytest.raises(CurationError, match="the curated loss masks keep .* tokens, the audit counts"):
            curate(buf, load_recipe("d3s"), {"where": "true"})
        assert buf.manifest.latest_seq() == seq
    assert not [f for d in ("curated", "audit") for _, _, fs in os.walk(os.path.join(root, d)) for f in fs]
    # the audit, written under tmp/ beside the materialisation, went with its folder
    assert not [f for _, ds, fs in os.walk(os.path.join(root, "tmp")) for f in ds + fs]
    assert not os.listdir(os.path.join(root, "audit"))
    with Buffer.open(root) as buf:  # and the same curation, once the masks are right, commits it
        monkeypatch.setattr(kernels, "keep_runs", real)
        out = curate(buf, load_recipe("d3s"), {"where": "true"})
        assert out.committed and buf.manifest.latest_seq() == seq + 1
    assert os.path.exists(os.path.join(root, "audit", out.curation_id, "audit.parquet"))
    assert not [f for _, ds, fs in os.walk(os.path.join(root, "tmp")) for f in ds + fs]


def test_entropies_that_do_not_match_the_token_count_are_one_line_naming_the_row():
    import pytest

    table = pa.table({"rollout_id": ["a", "b"], "advantage": pa.array([1.0, 1.0], pa.float32()),
                      "tokens": pa.array([2, 3], pa.int32()),
                      "entropies": pa.array([[0.5, 1.0], [0.5]], pa.list_(pa.float32()))})
    with pytest.raises(CurationError, match="rollout_id='b': column 'entropies' holds 1 values, its response has 3"):
        keep_runs(table, "entropy", mask_values(None))
