"""Round trip through `rollstore import`: rows come back equal, bit for bit, from JSONL and Parquet;
`--compact-entropies` keeps entropies within bf16 precision and log-probs exact; shards carry the
encodings of stack-notes.md (BYTE_STREAM_SPLIT on float leaf paths, zstd)."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from conftest import write_jsonl, write_parquet
from rollstore.builtin.synthetic import RowOptions, rollouts_table
from rollstore.storage.buffer import Buffer
from rollstore.storage.schema import ROLLOUTS, ROLLOUTS_STORED, TOKEN_LIST_COLUMNS

FLOAT_LEAVES = ("gen_logprobs.list.element", "old_logprobs.list.element", "entropies.list.element", "reward")


def awkward_table(prefix: str) -> pa.Table:
    """Synthetic rows plus edge values: -0.0, 0.0, denormals, tiny/huge magnitudes, nulls, unicode."""
    t = rollouts_table(n_groups=6, group_size=4, mean_tokens=12, seed=7, options=RowOptions(id_prefix=prefix))
    rows = t.to_pylist()
    n = len(rows[0]["response_token_ids"])
    rows[0]["entropies"] = [-0.0, 0.0, 1e-45, 3.4e38, 1.0078124, 2.5][:n] + [1.0] * max(0, n - 6)
    rows[0]["gen_logprobs"] = [-0.0, -1e-45, -1e-30, -88.7, -0.1, 0.0][:n] + [-1.0] * max(0, n - 6)
    rows[1]["old_logprobs"] = None
    rows[1]["entropies"] = None
    rows[2]["correct"] = None
    rows[2]["meta"] = '{"k": [1, 2], "é": "ü → ∑"}'
    rows[3]["response"] = "line one\nline two\t\"quoted\" \\ back"
    rows[3]["reward"] = -0.0
    rows[4]["reward"] = 1.401298464324817e-45
    return pa.Table.from_pylist(rows, schema=ROLLOUTS)


def read_back(root: str) -> pa.Table:
    with Buffer.open(root) as buf:
        return buf.snapshot().arrow("rollouts").to_table()


def by_id(table: pa.Table) -> pa.Table:
    return table.sort_by("rollout_id")


def float_bits(table: pa.Table, name: str) -> np.ndarray:
    col = table.column(name).combine_chunks()
    if pa.types.is_list(col.type):
        col = pc.list_flatten(col)
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float32).view(np.uint32)


def test_jsonl_and_parquet_round_trip_bit_exact(cli, buffer_dir, tmp_path):
    a, b = awkward_table("j"), awkward_table("p")
    for path in (write_jsonl(a, tmp_path / "a.jsonl"), write_parquet(b, tmp_path / "b.parquet")):
        res = cli("import", buffer_dir, path)
        assert res.code == 0, res.stderr
    back = by_id(read_back(buffer_dir))
    expected = by_id(pa.concat_tables([a, b]))
    assert back.schema == ROLLOUTS
    assert back.equals(expected), "imported rows differ from the file's rows"
    for name in ("reward",) + TOKEN_LIST_COLUMNS:  # equals() treats -0.0 == 0.0: check the bits too
        assert np.array_equal(float_bits(back, name), float_bits(expected, name)), name


def test_compact_entropies_bf16_precision_and_exact_logprobs(cli, buffer_dir, tmp_path):
    t = awkward_table("c")
    res = cli("import", buffer_dir, write_parquet(t, tmp_path / "c.parquet"), "--compact-entropies")
    assert res.code == 0, res.stderr
    back, t = by_id(read_back(buffer_dir)), by_id(t)
    for name in ("gen_logprobs", "old_logprobs", "reward"):
        assert np.array_equal(float_bits(back, name), float_bits(t, name)), name
    assert back.drop_columns(["entropies"]).equals(t.drop_columns(["entropies"]))
    # nulls stay null, list lengths unchanged
    assert back.column("entropies").is_null().equals(t.column("entropies").is_null())
    assert pc.list_value_length(back.column("entropies")).equals(pc.list_value_length(t.column("entropies")))
    got_bits = float_bits(back, "entropies")
    assert not (got_bits & 0xFFFF).any(), "low 16 mantissa bits must be zero"
    got = got_bits.view(np.float32).astype(np.float64)
    want = float_bits(t, "entropies").view(np.float32).astype(np.float64)
    assert np.all(np.isfinite(got))
    normal = np.abs(want) >= 2.0**-126  # bf16 has float32's exponent range
    rel = np.abs(got[normal] - want[normal]) / np.abs(want[normal])
    assert rel.max() <= 2.0**-8, f"relative error {rel.max():.3g} > 2^-8"
    # subnormals: within half a bf16 subnormal step (2^-133 / 2)
    assert np.all(np.abs(got[~normal] - want[~normal]) <= 2.0**-134)


def test_shard_encodings(cli, buffer_dir, tmp_path):
    t = rollouts_table(n_groups=8, group_size=4, mean_tokens=32)
    assert cli("import", buffer_dir, write_parquet(t, tmp_path / "t.parquet")).code == 0
    with Buffer.open(buffer_dir) as buf:
        (shard,) = buf.snapshot().shards("rollouts")
    meta = pq.ParquetFile(os.path.join(buffer_dir, shard.path)).metadata
    assert meta.num_rows == shard.rows == t.num_rows
    seen = set()
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            assert col.compression == "ZSTD", (col.path_in_schema, col.compression)
            if col.path_in_schema in FLOAT_LEAVES:
                assert "BYTE_STREAM_SPLIT" in col.encodings, (col.path_in_schema, col.encodings)
                assert col.physical_type == "FLOAT"
                seen.add(col.path_in_schema)
    assert seen == set(FLOAT_LEAVES)
    # the stored Arrow schema is the contract's, with each response's length (schema version 3)
    assert pq.read_schema(os.path.join(buffer_dir, shard.path)).remove_metadata() == ROLLOUTS_STORED
