"""Each shard's schema recorded by its commit (`storage.shard_schemas`): a reader binding a table's every
file learns each file's columns from the catalog, not from its footer, and learns the same thing.

Built through the real call paths (appends with prompt selections, curations, a compaction of every
compactable table, a checkpoint), on both catalogs: every recorded schema equals its file's footer
schema, the views bind with the same union decisions, a report reads no footer of a recorded shard
and writes the same page as one from footers alone; a file whose size is not the recorded one is read
from its footer; a catalog without the records (an older buffer) still reads."""

from __future__ import annotations

import os

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollstore.builtin.synthetic import rollouts_table
from rollstore.curate.params import load_recipe, step_where
from rollstore.curate.run import curate
from rollstore.storage import shard_schemas, snapshot
from rollstore.storage.buffer import Buffer
from rollstore.storage.maintenance import compact
from rollstore.storage.schema import TABLES

from test_report import data_blocks, same  # noqa: E402

RECIPE = load_recipe("d3s")


class _Weights:
    """What save_checkpoint asks of a model (its weights written to a folder), without a model."""

    def save_pretrained(self, folder, safe_serialization=True):
        with open(os.path.join(folder, "weights.bin"), "wb") as f:
            f.write(b"w" * 100)


def _history(buf: Buffer) -> None:
    from rollstore.learner.checkpoint import Publish, save_checkpoint

    for s in range(3):
        buf.append_rollouts(rollouts_table(n_groups=3, group_size=4, mean_tokens=8, seed=s, run_id="r", step=s,
                                           n_prompts=3), source=f"s{s}")
        curate(buf, RECIPE, {"where": step_where("r", s), "progress": "0.5"})
    compact(buf, "rollouts")
    save_checkpoint(buf, _Weights(), publish=Publish(1, "r", [{"curation_id": "c", "shard": "x"}]))


def _fresh_process() -> None:
    shard_schemas.forget()
    snapshot._schema.cache_clear()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_recorded_schemas_are_the_footers(tmp_path, request, kind):
    catalog = request.getfixturevalue("pg").fresh_dsn() if kind == "postgres" else None
    with Buffer.init(str(tmp_path / "b"), catalog=catalog) as buf:
        _history(buf)
        snap = buf.snapshot()
        shards = [s for t in TABLES for s in snap._listed(t)]
        recorded = buf.manifest.shard_schemas([s.shard_id for s in shards])
        assert set(recorded) == {s.shard_id for s in shards}  # every shard of every path has its record
        assert {s.table_name for s in shards} >= {"rollouts", "curated", "selections", "curations", "checkpoints"}
        for s in shards:
            footer = pq.read_schema(os.path.join(buf.root, s.path))
            assert pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(recorded[s.shard_id]))).equals(footer), s.path
        by_footer = {t: snapshot.union_option(snap.files(t)) for t in TABLES}
        thin_by_footer = [snapshot.is_thin(snapshot.file_schema(f)) for f in snap.files("curated")]
        _fresh_process()
        snap.register_duckdb(duckdb.connect())  # declares them
        assert {t: snapshot.union_option(snap.files(t)) for t in TABLES} == by_footer
        assert [snapshot.is_thin(snapshot.file_schema(f)) for f in snap.files("curated")] == thin_by_footer
        assert snapshot._schema.cache_info().misses == 0  # no footer was read


def test_a_report_reads_no_recorded_footer_and_writes_the_same_page(tmp_path, cli):
    root = str(tmp_path / "b")
    with Buffer.init(root) as buf:
        _history(buf)
    pages = {}
    for how in ("recorded", "footers"):
        _fresh_process()
        if how == "footers":  # an older buffer: its catalog holds no records
            with Buffer.open(root) as buf:
                with buf.manifest.transaction() as con:
                    con.execute("DELETE FROM shard_schemas")
        out = str(tmp_path / f"{how}.html")
        assert cli("report", root, "--out", out).code == 0
        reads = snapshot._schema.cache_info().misses
        assert (reads == 0) if how == "recorded" else (reads > 0), (how, reads)
        pages[how] = open(out, encoding="utf-8").read()
    assert same(data_blocks(pages["recorded"]), data_blocks(pages["footers"]))  # (floats: summation order)


def test_a_file_not_of_its_recorded_size_is_read_from_its_footer(tmp_path):
    with Buffer.init(str(tmp_path / "b")) as buf:
        buf.append_rollouts(rollouts_table(n_groups=2, group_size=2, seed=1), source="a")
        snap = buf.snapshot()
        snap.register_duckdb(duckdb.connect())
        (path,) = snap.files("rollouts")
        assert snapshot.file_schema(path) is shard_schemas.declared(path, os.path.getsize(path))
        other = pa.table({"x": [1, 2, 3]})
        pq.write_table(other, path)  # (a damaged buffer: another file in its place)
        assert shard_schemas.declared(path, os.path.getsize(path)) is None
        assert snapshot.file_schema(path).names == ["x"]
