"""Snapshots: readers take their file list from the manifest (never a directory listing), an old
seq keeps its view while appends land, and DuckDB, Polars and pyarrow agree on every snapshot."""

from __future__ import annotations

import json
import os
import shutil

import polars as pl
import pytest

from conftest import write_parquet
from rollstore.queries.session import Session
from rollstore.builtin.synthetic import RowOptions, rollouts_table
from rollstore.storage.buffer import Buffer
from rollstore.storage.errors import ManifestError
from rollstore.storage.schema import READ_SCHEMAS, ROLLOUTS_STORED, TABLES


def counts(snap) -> dict:
    """Rows and tokens of `rollouts` at a snapshot, by each of the three engines."""
    with Session(snap) as s:
        duck = s.execute("SELECT count(*), coalesce(sum(len(response_token_ids)), 0) FROM rollouts").fetchone()
    pol = snap.polars("rollouts").select(pl.len(), pl.col("response_token_ids").list.len().sum()).collect().row(0)
    table = snap.arrow("rollouts").to_table(columns=["response_token_ids"])
    arrow = (table.num_rows, sum(len(v) for v in table.column(0).to_pylist()))
    return {"duckdb": tuple(duck), "polars": tuple(pol), "arrow": arrow,
            "manifest": (snap.rows("rollouts"), sum(s.tokens for s in snap.shards("rollouts")))}


def assert_engines_agree(snap) -> tuple[int, int]:
    c = counts(snap)
    assert len(set(c.values())) == 1, c
    return c["duckdb"]


def sql_count(cli, root, *extra) -> int:
    res = cli("sql", root, "SELECT count(*) AS n FROM rollouts", "-f", "json", *extra)
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)[0]["n"]


def test_file_dropped_by_hand_is_invisible(cli, buffer_dir, tmp_path):
    with Buffer.open(buffer_dir) as buf:
        shard = buf.append_rollouts(rollouts_table(n_groups=2, group_size=4))
        # a copy of a real shard, and a foreign valid file, dropped straight into rollouts/
        shutil.copy(os.path.join(buffer_dir, shard.path), os.path.join(buffer_dir, "rollouts", "copy.parquet"))
        write_parquet(rollouts_table(n_groups=3, group_size=4, options=RowOptions(id_prefix="x")),
                      os.path.join(buffer_dir, "rollouts", "foreign.parquet"))
        snap = buf.snapshot()
        assert assert_engines_agree(snap)[0] == 8
    assert sql_count(cli, buffer_dir) == 8
    res = cli("sql", buffer_dir, "SELECT count(*) AS n FROM groups", "-f", "json")
    assert json.loads(res.stdout) == [{"n": 2}]


def test_old_snapshot_keeps_its_view(cli, buffer_dir):
    with Buffer.open(buffer_dir) as buf:
        buf.append_rollouts(rollouts_table(n_groups=2, group_size=4, step=0))
        old = buf.snapshot()
        for step in range(1, 4):
            buf.append_rollouts(rollouts_table(n_groups=2, group_size=4, step=step))
            assert assert_engines_agree(old) == assert_engines_agree(buf.snapshot(old.seq))
            assert old.rows("rollouts") == 8
        new = buf.snapshot()
        assert assert_engines_agree(new)[0] == 32
        assert new.seq == old.seq + 3
    assert sql_count(cli, buffer_dir, "--snapshot", str(old.seq)) == 8
    res = cli("sql", buffer_dir, "SELECT 1", "--snapshot", str(new.seq + 1))  # not yet committed
    assert res.code != 0 and "no snapshot" in res.stderr
    assert sql_count(cli, buffer_dir, "--snapshot", str(old.seq + 1)) == 16
    assert sql_count(cli, buffer_dir) == 32


def test_engines_agree_on_every_table_even_empty(buffer_dir):
    with Buffer.open(buffer_dir) as buf:
        snap = buf.snapshot()
        assert assert_engines_agree(snap) == (0, 0)
        for name, schema in READ_SCHEMAS.items():  # `curated` reads resolved (stored thin)
            assert snap.arrow(name).count_rows() == 0
            assert snap.arrow(name).schema == schema
            assert snap.polars(name).collect().columns == schema.names
            with Session(snap) as s:
                assert s.execute(f"SELECT count(*) FROM {name}").fetchone() == (0,)
        for i in range(3):
            buf.append_rollouts(rollouts_table(n_groups=1 + i, group_size=4, step=i, mean_tokens=9))
        assert assert_engines_agree(buf.snapshot())[0] == 24


@pytest.mark.parametrize("parent", ["k=1", "w[1]"])
def test_awkward_buffer_paths(cli, tmp_path, parent):
    """A buffer under a folder named like a hive partition or a glob pattern reads the same."""
    root = str(tmp_path / parent / "buf")
    assert cli("init", root).code == 0
    with Buffer.open(root) as buf:
        buf.append_rollouts(rollouts_table(n_groups=2, group_size=4))
        assert assert_engines_agree(buf.snapshot())[0] == 8
        with Session(buf.snapshot()) as s:
            assert [r[0] for r in s.execute("DESCRIBE rollouts").fetchall()] == ROLLOUTS_STORED.names  # the view adds the stored length
    assert sql_count(cli, root) == 8


def test_pinned_snapshot_unpins_on_close(buffer_dir):
    with Buffer.open(buffer_dir) as buf:
        with buf.snapshot(pin=True) as snap:
            assert buf.manifest.oldest_pinned_seq() == snap.seq
        assert buf.manifest.oldest_pinned_seq() is None


def test_pins_do_not_wait_for_the_disk_and_commits_do(buffer_dir):
    """A pin and its removal commit with synchronous=NORMAL (a loop pins a snapshot every curation: two
    fsyncs saved per pin); every other transaction, and the connection between them, stays FULL."""
    with Buffer.open(buffer_dir) as buf:
        con = buf.manifest.con
        seen: list[str] = []
        con.set_trace_callback(lambda stmt: seen.append(" ".join(stmt.split())))
        try:
            with buf.snapshot(pin=True):
                pass
            pragmas = [s for s in seen if s.startswith("PRAGMA synchronous")]
            inserts = [i for i, s in enumerate(seen) if s.startswith("INSERT INTO pins")]
            deletes = [i for i, s in enumerate(seen) if s.startswith("DELETE FROM pins")]
            assert len(inserts) == 1 and len(deletes) == 1, seen
            for at in inserts + deletes:  # NORMAL from before BEGIN to after COMMIT
                before = [s for s in seen[:at] if s.startswith("PRAGMA synchronous")][-1]
                after = [s for s in seen[at:] if s.startswith("PRAGMA synchronous")][0]
                assert before == "PRAGMA synchronous=NORMAL" and after == "PRAGMA synchronous=FULL", seen
            assert pragmas == ["PRAGMA synchronous=NORMAL", "PRAGMA synchronous=FULL"] * 2
            seen.clear()
            buf.append_rollouts(rollouts_table(n_groups=1, group_size=2, seed=5), "s")
            assert not [s for s in seen if s.startswith("PRAGMA synchronous")], seen
        finally:
            con.set_trace_callback(None)
        assert con.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_a_commit_makes_its_files_and_folders_durable_before_its_transaction(buffer_dir, monkeypatch):
    """`Buffer.commit` fsyncs every file it publishes, the file's folder and the parent of every folder it
    made (a curation's curated/<id>/ and audit/<id>/), all before the transaction that names them."""
    import rollstore.storage.manifest as manifest_module
    import rollstore.storage.shardio as shardio
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate

    with Buffer.open(buffer_dir) as buf:
        buf.append_rollouts(rollouts_table(n_groups=4, group_size=4, seed=3), "s")
    events: list[tuple[str, str]] = []
    real_fsync, real_commit = shardio.fsync_dir, manifest_module.Manifest.new_commit
    monkeypatch.setattr(shardio, "fsync_dir", lambda path: (events.append(("fsync", path)), real_fsync(path))[1])
    monkeypatch.setattr(manifest_module.Manifest, "new_commit",
                        lambda self, *a, **k: (events.append(("commit", "")), real_commit(self, *a, **k))[1])
    with Buffer.open(buffer_dir) as buf:
        out = curate(buf, load_recipe("grpo"), {"where": "true"})
        latest = buf.manifest.latest_seq()
        published = [s.path for s in buf.manifest.shards() if s.added_seq == latest]
    assert [kind for kind, _ in events].count("commit") == 1
    synced = {os.path.relpath(path, buffer_dir) for kind, path in events[:events.index(("commit", ""))] if kind == "fsync"}
    cid = out.curation_id
    for folder in ("curated", "audit"):  # a new folder per curation: its own entry is durable through its parent
        assert {folder, f"{folder}/{cid}"} <= synced, synced
        assert any(p.startswith(f"{folder}/{cid}/") and p.endswith(".parquet") for p in synced), synced
    assert "meta/curations" in synced and any(p.startswith("meta/curations/") for p in synced), synced
    assert len(published) == 3 and set(published) <= synced, (published, synced)  # curated, audit, record


def test_unknown_buffer_is_one_error_line(cli, tmp_path):
    res = cli("sql", str(tmp_path / "nope"), "SELECT 1")
    assert res.code != 0 and "not a rollstore buffer" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    with pytest.raises(ManifestError):
        Buffer.open(str(tmp_path / "nope"))


def test_column_at_answers_a_second_read_of_the_same_rows_from_its_cache(buffer_dir, monkeypatch):
    """`references.column_at` keeps its last decoded columns: a later read of any subset of those rows, in any
    order, gives the same values without decoding the file; a file replaced at the same path is read again."""
    import numpy as np
    import pyarrow.parquet as pq_

    from rollstore.storage import references

    with Buffer.open(buffer_dir) as buf:
        buf.append_rollouts(rollouts_table(n_groups=6, group_size=4, seed=8))
        path = buf.snapshot().files("rollouts")[0]
    truth = pq_.read_table(path, columns=["entropies"]).column(0).combine_chunks()
    decoded = []
    real = references._read_rows
    monkeypatch.setattr(references, "_read_rows", lambda *a, **k: (decoded.append(a[0]), real(*a, **k))[1])
    references._columns.clear()
    first = np.array([3, 17, 5, 11, 20, 0])
    assert references.column_at(path, first, "entropies", "t").equals(truth.take(first))
    again = np.array([11, 0, 17])
    assert references.column_at(path, again, "entropies", "t").equals(truth.take(again))
    assert len(decoded) == 1  # the subset came from the cache
    assert references.column_at(path, np.array([1, 3]), "entropies", "t").equals(truth.take([1, 3]))
    assert len(decoded) == 2  # row 1 was never read: decoded
    other = rollouts_table(n_groups=6, group_size=4, seed=9).select(["entropies"])
    os.replace(write_parquet(other, path + ".new"), path)  # another file at the same path (another inode)
    assert references.column_at(path, again, "entropies", "t").equals(
        pq_.read_table(path).column("entropies").combine_chunks().take(again))
    assert len(decoded) == 3
