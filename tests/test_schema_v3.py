"""Schema version 3 (issue 37, item 3, "decode once"): every rollouts shard stores its rows'
`response_length`, so the candidates' scan decodes no token list. Buffers of version 2 keep
working (the length computed where the column is missing), a buffer mixing both works, `rollstore
migrate` and compaction write the column, and an interrupted migration leaves the old files live
and readable. Commands go through the real command line where there is one."""

from __future__ import annotations

import contextlib
import json
import os

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import rollstore.storage.buffer as buffer_module
from rollstore.curate.params import load_recipe
from rollstore.curate.run import curate
from rollstore.storage.buffer import Buffer
from rollstore.storage.schema import RESPONSE_LENGTH, ROLLOUTS
from rollstore.storage.snapshot import stores_response_length
from rollstore.builtin.synthetic import rollouts_table

from test_integrity_round2 import one_error_line, seq_of  # noqa: E402  (shared helpers)

STEPS = 4


@contextlib.contextmanager
def version_2_writer():
    """`Buffer.commit` as schema version 2 wrote rollouts shards: the appended columns only."""
    original = buffer_module.stored_table

    def stored_v2(part):
        if part.table_name != "rollouts":
            return original(part)
        table = part.table.select(ROLLOUTS.names).cast(ROLLOUTS)
        if part.metadata:
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), **part.metadata})
        return table

    buffer_module.stored_table = stored_v2
    try:
        yield
    finally:
        buffer_module.stored_table = original


def build(root: str, old_steps: set[int]) -> None:
    """STEPS steps of synthetic rollouts, one shard each; the steps in `old_steps` written as version 2."""
    with Buffer.init(root) as buf:
        for step in range(STEPS):
            table = rollouts_table(n_groups=6, group_size=4, step=step, policy_version=step, seed=40 + step)
            with version_2_writer() if step in old_steps else contextlib.nullcontext():
                buf.append_rollouts(table)


def files(root: str) -> list[str]:
    with Buffer.open(root) as buf, buf.snapshot() as snap:
        return snap.files("rollouts")


def decisions(root: str, recipe: str, engine="embedded") -> tuple:
    """What a curation decides (record numbers, every audit row) and its id."""
    with Buffer.open(root) as buf:
        res = curate(buf, load_recipe(recipe), {"where": "step >= 1", "progress": "0.3"}, commit=False, engine=engine)
    record = {k: v for k, v in res.record.items() if k not in ("created_at", "output_files", "curation_id",
                                                                "snapshot_seq")}
    audit = res.audit.drop_columns([c for c in ("created_at", "curation_id") if c in res.audit.column_names])
    audit = audit.sort_by("rollout_id")
    return res.curation_id, record, audit.to_pylist()


def test_new_shards_store_the_response_length_and_readers_see_the_contract(buffer_dir):
    with Buffer.open(buffer_dir) as buf:
        table = rollouts_table(n_groups=3, group_size=4, seed=1)
        shard = buf.append_rollouts(table)
        path = os.path.join(buffer_dir, shard.path)
        stored = pq.read_table(path)
        assert stored.column(RESPONSE_LENGTH).to_pylist() == [len(x) for x in table.column("response_token_ids").to_pylist()]
        assert pq.read_schema(path).field(RESPONSE_LENGTH).type == pa.int32() and stores_response_length(path)
        with buf.snapshot() as snap:  # the Arrow reader keeps the import contract (ROLLOUTS)
            assert snap.arrow("rollouts").to_table().schema.names == ROLLOUTS.names


def test_an_input_column_named_response_length_is_refused(cli, buffer_dir, tmp_path):
    """The length is always computed at commit, never taken from the input."""
    table = rollouts_table(n_groups=2, group_size=2, seed=2)
    table = table.append_column(RESPONSE_LENGTH, pa.array([99] * table.num_rows, pa.int32()))
    path = str(tmp_path / "in.parquet")
    pq.write_table(table, path)
    line = one_error_line(cli("import", buffer_dir, path))
    assert RESPONSE_LENGTH in line and "unknown column" in line, line


@pytest.mark.parametrize("recipe", ["grpo", "d3s", "da3po", "pods", "replay-window"])
def test_version_2_and_mixed_buffers_decide_as_version_3(tmp_path, recipe):
    """The same rows as version 3, version 2, and a mix of both: the same curation id (the plan does
    not depend on the shards' version) and the same decisions."""
    got = {}
    for name, old in (("v3", set()), ("v2", set(range(STEPS))), ("mixed", {0, 2})):
        root = str(tmp_path / name)
        build(root, old)
        assert [stores_response_length(f) for f in files(root)] == [s not in old for s in range(STEPS)]
        got[name] = decisions(root, recipe)
    assert got["v2"] == got["v3"] and got["mixed"] == got["v3"]


def test_the_sql_view_shows_the_length_of_every_row(cli, tmp_path):
    root = str(tmp_path / "mixed")
    build(root, {1})
    res = cli("sql", root, f"SELECT count(*) AS n, count({RESPONSE_LENGTH}) AS with_length, "
                           f"count(*) FILTER (WHERE {RESPONSE_LENGTH} = len(response_token_ids)) AS equal "
                           "FROM rollouts", "-f", "json")
    assert res.code == 0, res.stderr
    (row,) = json.loads(res.stdout)
    assert row["n"] == STEPS * 24 and row["with_length"] == row["n"] and row["equal"] == row["n"]
    with Buffer.open(root) as buf, buf.snapshot() as snap:  # the dataframe readers keep the import contract
        assert snap.polars("rollouts").collect().columns == ROLLOUTS.names
        assert snap.arrow("rollouts").to_table().num_rows == STEPS * 24


def _rows(root: str) -> pa.Table:
    with Buffer.open(root) as buf, buf.snapshot() as snap:
        return snap.arrow("rollouts").to_table().sort_by("rollout_id")


def test_migrate_writes_the_length_and_changes_no_row(cli, tmp_path):
    root = str(tmp_path / "buf")
    build(root, {0, 1, 2})
    before = _rows(root)
    # a live curation refers to the shard of step 1: it is rewritten too, the references follow it
    assert cli("curate", root, "--recipe", "grpo", "--set", "where=step = 1").code == 0
    with Buffer.open(root) as buf, buf.snapshot() as snap:
        curated = snap.curated()
    decided = decisions(root, "d3s")
    res = cli("migrate", root)
    assert res.code == 0, res.stderr
    assert "rewrote 3 rollouts shards (72 rows)" in res.stdout, res.stdout
    assert sorted(stores_response_length(f) for f in files(root)) == [True, True, True, True]
    assert _rows(root).equals(before)
    with Buffer.open(root) as buf, buf.snapshot() as snap:
        assert snap.curated().equals(curated)
    cid, record, audit = decisions(root, "d3s")
    assert (record, audit) == decided[1:]  # a new snapshot: a new id, the same decisions
    again = cli("migrate", root)
    assert again.code == 0 and "rewrote 0 rollouts shards" in again.stdout
    assert cli("verify", root).code == 0


def test_an_interrupted_migration_leaves_the_old_files_live_and_readable(cli, tmp_path, monkeypatch):
    root = str(tmp_path / "buf")
    build(root, {0, 1, 2, 3})
    before, seq = _rows(root), seq_of(root)
    old_files = files(root)

    from rollstore.storage.manifest import Manifest

    def interrupted(self, con, seq, shards):
        raise KeyboardInterrupt  # killed between writing the new files and the manifest commit

    monkeypatch.setattr(Manifest, "add_shards", interrupted)
    with Buffer.open(root) as buf:
        from rollstore.storage.maintenance import migrate

        with pytest.raises(KeyboardInterrupt):
            migrate(buf)
    monkeypatch.undo()
    assert seq_of(root) == seq and files(root) == old_files
    assert not any(stores_response_length(f) for f in old_files)
    assert _rows(root).equals(before)
    assert cli("verify", root).code == 0
    assert cli("curate", root, "--recipe", "d3s", "--set", "where=step = 1").code == 0
    res = cli("migrate", root)  # and it can be run again (the shard the curation refers to too)
    assert res.code == 0 and "rewrote 4 rollouts shards" in res.stdout, res.stdout
    assert sorted(stores_response_length(f) for f in files(root)) == [True, True, True, True]
    assert _rows(root).equals(before)


def test_compaction_writes_the_length_over_shards_of_both_versions(cli, tmp_path):
    root = str(tmp_path / "buf")
    build(root, {0, 2})
    before = _rows(root)
    res = cli("compact", root)
    assert res.code == 0, res.stderr
    (merged,) = files(root)
    stored = pq.read_table(merged)
    assert stores_response_length(merged)
    assert pc.all(pc.equal(stored.column(RESPONSE_LENGTH),
                           pc.list_value_length(stored.column("response_token_ids")))).as_py()
    assert _rows(root).equals(before)


def test_the_dask_engine_on_a_mixed_buffer(tmp_path):
    distributed = pytest.importorskip("distributed")
    from rollstore.curate.options import Dask

    root = str(tmp_path / "mixed")
    build(root, {1, 3})
    embedded = decisions(root, "d3s")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster:
        on_dask = decisions(root, "d3s", engine=Dask(cluster.scheduler_address))
    assert on_dask == embedded


def test_decode_cost_bench_smoke(tmp_path):
    """`bench.decode_cost` runs (its numbers are in bench/RESULTS.md)."""
    from bench import common
    from bench.decode_cost import measure

    root = str(tmp_path / "bench")
    common.build_buffer(root, 60_000, 30_000)
    out = measure(root, 1)
    assert out["selected rows"] > 0 and out["scan with response_length (stored)"] >= 0
