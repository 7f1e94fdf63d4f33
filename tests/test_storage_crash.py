"""Crash safety: a child process appends in a loop and is killed with SIGKILL at random moments (and
at three chosen points of a commit). After every kill each committed shard reads back with its
manifest sha256 and row count; a reader running meanwhile only ever sees whole shards; `gc --grace 0`
then removes every orphan in tmp/ and rollouts/ and nothing else.

The child is forked from a small zygote script that imported pyarrow once, so each of the 23
appender processes starts in milliseconds instead of a second."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq

from conftest import ROOT
from rollstore.queries.session import Session
from rollstore.storage.buffer import Buffer
from rollstore.storage.shardio import sha256_file

RANDOM_KILLS = 20
INJECTED = ("tmp", "linked", "synced", "in-txn")  # killed: after the temp write / after the link / after the
# commit's fsyncs (`shardio.Durable.flush`) / inside the txn

ZYGOTE = r"""
import os, signal, sys
sys.path.insert(0, {root!r})
import rollstore.storage.buffer, rollstore.storage.manifest, rollstore.storage.shardio
from rollstore import storage
from rollstore.builtin.synthetic import RowOptions, rollouts_table
import pyarrow
pyarrow.array([0]).to_numpy()  # pyarrow loads pandas at its first conversion: once here, not in every child

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def inject(point):
    if point == "tmp":
        real = storage.shardio.write_parquet
        def write_then_die(table, path, *a, **k):
            real(table, path, *a, **k)
            die()
        storage.shardio.write_parquet = write_then_die
    elif point == "linked":
        real_link = os.link
        def link_then_die(src, dst):
            real_link(src, dst)
            die()
        storage.shardio.os.link = link_then_die
    elif point == "synced":
        real_flush = storage.shardio.Durable.flush
        def flush_then_die(self):
            real_flush(self)
            die()
        storage.shardio.Durable.flush = flush_then_die
    elif point == "in-txn":
        real_add = storage.manifest.Manifest.add_shards
        def add_then_die(self, con, seq, shards):
            real_add(self, con, seq, shards)
            die()
        storage.manifest.Manifest.add_shards = add_then_die

print("ready", flush=True)
for gen, line in enumerate(sys.stdin):
    point = line.strip()
    pid = os.fork()
    if pid == 0:
        try:
            inject(point)
            buf = storage.buffer.Buffer.open({buffer!r})
            i = 0
            while True:
                buf.append_rollouts(rollouts_table(n_groups=1 + i % 3, group_size=4, mean_tokens=48,
                                                   seed=i, step=i, options=RowOptions(id_prefix=f"c{{gen}}-{{i}}")))
                i += 1
        finally:
            os._exit(3)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(f"dead {{status}}", flush=True)
"""


def whole_shards_only(root: str) -> int:
    """One reader pass: DuckDB over a snapshot counts exactly the manifest's whole shards."""
    with Buffer.open(root) as buf, buf.snapshot() as snap, Session(snap, threads=1) as s:
        n = s.execute("SELECT count(*) FROM rollouts").fetchone()[0]
        groups_ok = s.execute("SELECT count(*) FROM groups WHERE size <> 4").fetchone()[0] == 0
        assert n == snap.rows("rollouts"), f"reader saw {n} rows, committed shards hold {snap.rows('rollouts')}"
        assert groups_ok
        return n


def verify_committed(root: str, checked: dict) -> int:
    """Every live shard: file present, sha256 and row count as in its manifest row. Returns rows."""
    with Buffer.open(root) as buf:
        con = buf.manifest.con
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        shards = buf.manifest.shards("rollouts")
        for s in shards:
            full = os.path.join(root, s.path)
            if checked.get(s.shard_id) == s.sha256:
                assert os.path.getsize(full) == s.bytes
                continue
            assert sha256_file(full) == s.sha256, s.path
            assert pq.ParquetFile(full).metadata.num_rows == s.rows, s.path
            assert pq.read_table(full).num_rows == s.rows
            checked[s.shard_id] = s.sha256
        rows = sum(s.rows for s in shards)
        ids = con.execute("SELECT count(*) FROM rollout_ids").fetchone()[0]
        assert ids == rows, "rollout_ids disagree with the committed shards"
        seqs = [r[0] for r in con.execute("SELECT seq FROM commits ORDER BY seq")]
        assert sorted(s.added_seq for s in shards) == seqs, "a commit row without its shard (or vice versa)"
        return rows


def test_sigkill_at_random_moments(cli, buffer_dir, tmp_path):
    script = tmp_path / "zygote.py"
    script.write_text(ZYGOTE.format(root=ROOT, buffer=buffer_dir))
    zygote = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, bufsize=1)
    rng = random.Random(1234)
    plan = [""] * RANDOM_KILLS
    for point in INJECTED:
        plan.insert(rng.randrange(len(plan)), point)
    checked: dict = {}
    rows_seen = [0]
    reads = 0
    try:
        assert zygote.stdout.readline().strip() == "ready"
        for point in plan:
            zygote.stdin.write(point + "\n")
            pid = int(zygote.stdout.readline())
            if point:  # an injected crash kills itself at its point
                status = zygote.stdout.readline().split()
            else:
                deadline = time.monotonic() + rng.uniform(0.02, 0.25)
                while time.monotonic() < deadline:  # read while the child appends
                    n = whole_shards_only(buffer_dir)
                    assert n >= rows_seen[-1]
                    rows_seen.append(n)
                    reads += 1
                os.kill(pid, signal.SIGKILL)
                status = zygote.stdout.readline().split()
            assert status[0] == "dead"
            assert os.WIFSIGNALED(int(status[1])) and os.WTERMSIG(int(status[1])) == signal.SIGKILL, point
            rows = verify_committed(buffer_dir, checked)
            assert rows >= rows_seen[-1]
            rows_seen.append(rows)
    finally:
        zygote.stdin.close()
        zygote.kill()
        zygote.wait()
    print(f"kills={len(plan)} reads={reads} rows={rows_seen[-1]} shards={len(checked)}")
    assert len(plan) >= 20 and reads >= 20
    assert rows_seen[-1] > 0, "the children never committed anything"

    def unreferenced():
        with Buffer.open(buffer_dir) as buf:
            known = buf.manifest.all_paths()
        found = {os.path.relpath(os.path.join(d, f), buffer_dir)
                 for top in ("rollouts", "tmp") for d, _, fs in os.walk(os.path.join(buffer_dir, top)) for f in fs}
        return found - known

    orphans = unreferenced()
    assert any(p.startswith("tmp/") for p in orphans), "no orphan in tmp/ (the 'tmp' crash leaves one)"
    assert any(p.startswith("rollouts/") for p in orphans), "no orphan in rollouts/ ('linked', 'in-txn')"
    res = cli("gc", buffer_dir)  # default grace: fresh orphans stay (they could be a live write)
    assert res.code == 0 and "removed 0 orphan" in res.stdout, res.stdout
    res = cli("gc", buffer_dir, "--grace", "0")
    assert res.code == 0 and f"removed {len(orphans)} orphan" in res.stdout, (res.stdout, orphans)
    assert unreferenced() == set()
    assert verify_committed(buffer_dir, {}) == rows_seen[-1]  # gc touched no live shard
    assert whole_shards_only(buffer_dir) == rows_seen[-1]
    # the buffer still takes appends after all those crashes
    from rollstore.builtin.synthetic import RowOptions, rollouts_table

    with Buffer.open(buffer_dir) as buf:
        buf.append_rollouts(rollouts_table(n_groups=1, group_size=4, options=RowOptions(id_prefix="after")))
    assert whole_shards_only(buffer_dir) == rows_seen[-1] + 4
