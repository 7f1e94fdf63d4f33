"""`verify --incremental` / `--since` / `--full`, and a verify that reads each compacted rollouts shard once."""

from __future__ import annotations

import os

import pyarrow.parquet as pq

from test_integrity_round3 import tiny_rows
from rollstore.curate.params import load_recipe
from rollstore.curate.run import curate
from rollstore.storage import references
from rollstore.storage.buffer import Buffer
from rollstore.storage.maintenance import compact
from rollstore.storage.verify import scan_references


def steps(root: str, first: int, n: int) -> None:
    with Buffer.open(root) as buf:
        for step in range(first, first + n):
            buf.append_rollouts(tiny_rows(step, step=step))
            curate(buf, load_recipe("grpo"), {"where": f"step = {step}"})


def flip_a_byte(path: str) -> None:
    """Corrupt a file in place at the same size (bit rot)."""
    with open(path, "r+b") as fh:
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_incremental_hashes_only_what_no_verify_hashed_and_full_scrubs_all(buffer_dir, cli):
    steps(buffer_dir, 0, 2)
    res = cli("verify", buffer_dir)
    assert res.code == 0 and "shards verified" in res.stdout
    total = int(res.stdout.split()[0])
    steps(buffer_dir, 2, 1)
    res = cli("verify", buffer_dir, "--incremental")
    assert res.code == 0, res.stderr
    hashed = int(res.stdout.split("(")[1].split()[0])
    assert 0 < hashed < total  # the new step's shards only
    res = cli("verify", buffer_dir, "--incremental")
    assert res.code == 0 and "(0 hashed)" in res.stdout
    with Buffer.open(buffer_dir) as buf:
        old = buf.manifest.shards("rollouts")[0]
    flip_a_byte(os.path.join(buffer_dir, old.path))  # bit rot in a shard verified before
    assert cli("verify", buffer_dir, "--incremental").code == 0  # documented: only --full hashes it again
    res = cli("verify", buffer_dir, "--full")
    assert res.code != 0 and old.path in res.stderr and "sha256" in res.stderr


def test_incremental_catches_a_new_bad_shard_and_a_missing_old_one(buffer_dir, cli):
    steps(buffer_dir, 0, 1)
    assert cli("verify", buffer_dir).code == 0
    steps(buffer_dir, 1, 1)
    with Buffer.open(buffer_dir) as buf:
        new, first = buf.manifest.shards("rollouts")[-1], buf.manifest.shards("rollouts")[0]
    flip_a_byte(os.path.join(buffer_dir, new.path))
    res = cli("verify", buffer_dir, "--incremental")
    assert res.code != 0 and new.path in res.stderr
    os.unlink(os.path.join(buffer_dir, first.path))
    res = cli("verify", buffer_dir, "--incremental")
    assert first.path in res.stderr and "missing" in res.stderr


def test_since_hashes_later_commits_and_refuses_the_future(buffer_dir, cli):
    steps(buffer_dir, 0, 2)
    with Buffer.open(buffer_dir) as buf:
        latest = buf.manifest.latest_seq()
    res = cli("verify", buffer_dir, "--since", str(latest))
    assert res.code == 0 and "(0 hashed)" in res.stdout
    res = cli("verify", buffer_dir, "--since", str(latest + 5))
    assert res.code != 0 and f"--since {latest + 5}" in res.stderr and f"newest commit is {latest}" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = cli("verify", buffer_dir, "--full", "--incremental")
    assert res.code != 0 and "--full" in res.stderr


def test_references_into_a_compacted_shard_read_it_once(buffer_dir, monkeypatch):
    steps(buffer_dir, 0, 6)
    with Buffer.open(buffer_dir) as buf:
        assert compact(buf).merged_shards == 6
        merged = os.path.join(buffer_dir, buf.manifest.shards("rollouts")[0].path)
        reads = []
        real = pq.read_table

        def counting(path, *a, **kw):
            reads.append(str(path))
            return real(path, *a, **kw)

        monkeypatch.setattr(references.pq, "read_table", counting)
        assert len(buf.manifest.shards("curated")) >= 6
        assert scan_references(buffer_dir, buf.manifest) == []
        assert reads.count(merged) == 1
