"""Concurrency: an appending process and a querying process; consumers leasing one table's shards
concurrently through their own manifest connections; racing appenders of the same ids."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import polars as pl
import pytest

from conftest import ROOT
from rollstore.queries.session import Session
from rollstore.builtin.synthetic import RowOptions, rollouts_table
from rollstore.storage.buffer import Buffer
from rollstore.storage.errors import ValidationError

GROUP = 4

APPENDER = """
import os, sys
sys.path.insert(0, {root!r})
from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer
buf = Buffer.open({buffer!r})
print("ready", flush=True)
step = 0
while not os.path.exists({stop!r}) and step < 400:  # until the reader has seen enough
    buf.append_rollouts(rollouts_table(n_groups=1 + step % 3, group_size={group}, mean_tokens=8, step=step))
    step += 1
print(step, flush=True)
"""


def test_counts_only_grow_and_snapshots_are_consistent(buffer_dir, tmp_path):
    script, stop = tmp_path / "appender.py", tmp_path / "stop"
    script.write_text(APPENDER.format(root=ROOT, buffer=buffer_dir, group=GROUP, stop=str(stop)))
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        seen: list[int] = []
        with Buffer.open(buffer_dir) as buf:
            while True:
                if len(set(seen)) >= 6 or len(seen) >= 200:
                    stop.touch()
                finished = child.poll() is not None  # decide before reading: the last read sees all
                with buf.snapshot(pin=True) as snap, Session(snap) as s:
                    n, bad_groups, groups = s.execute(
                        "SELECT (SELECT count(*) FROM rollouts), "
                        f"(SELECT count(*) FROM groups WHERE size <> {GROUP}), (SELECT count(*) FROM groups)"
                    ).fetchone()
                    assert bad_groups == 0, "a snapshot holds an incomplete group"
                    assert n == snap.rows("rollouts") == groups * GROUP
                    assert snap.polars("rollouts").select(pl.len()).collect().item() == n
                    assert not seen or n >= seen[-1], f"count went down: {seen[-1]} -> {n}"
                    seen.append(n)
                if finished:
                    break
        assert child.wait(timeout=60) == 0
        steps = int(child.stdout.readline())
        assert seen[-1] == sum((1 + step % 3) * GROUP for step in range(steps))
        assert len(set(seen)) >= 3, f"reader never overlapped the writer: {sorted(set(seen))}"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.fixture
def leasable(buffer_dir):
    """A buffer with 16 rollout shards; returns (root, shard ids)."""
    with Buffer.open(buffer_dir) as buf:
        ids = [buf.append_rollouts(rollouts_table(n_groups=1, group_size=2, mean_tokens=2, step=i)).shard_id
               for i in range(16)]
    return buffer_dir, ids


def test_two_consumers_lease_disjoint_shards(leasable):
    root, all_ids = leasable
    got: dict[str, list[int]] = {"a": [], "b": []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def consume(name: str, n: int) -> None:
        try:
            with Buffer.open(root) as buf:  # its own manifest connection
                start.wait()
                while True:
                    _, shards = buf.lease("rollouts", n, consumer=name, group="train")
                    if not shards:
                        return
                    got[name] += [s.shard_id for s in shards]
                    assert buf.ack(shards, consumer=name, group="train") == len(shards)
        except BaseException as exc:  # surface in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=("a", 1)), threading.Thread(target=consume, args=("b", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert set(got["a"]) & set(got["b"]) == set(), "a shard was leased twice"
    assert sorted(got["a"] + got["b"]) == sorted(all_ids), "union is not every shard"
    assert len(got["a"]) + len(got["b"]) == len(all_ids)
    with Buffer.open(root) as buf:  # everything acked: nothing left, also for the same group later
        assert buf.lease("rollouts", 100, "c", group="train")[1] == []
        assert len(buf.lease("rollouts", 100, "c", group="eval")[1]) == 16  # another group is separate


def test_lease_expiry_returns_unacked_shards(leasable):
    root, all_ids = leasable
    with Buffer.open(root) as a, Buffer.open(root) as b:
        _, held = a.lease("rollouts", 3, consumer="a", ttl=0.3)
        assert [s.shard_id for s in held] == all_ids[:3]
        assert a.ack(held[:1], consumer="a") == 1
        _, other = b.lease("rollouts", 100, consumer="b", ttl=60)
        assert {s.shard_id for s in other} == set(all_ids[3:])  # a's leases still hold
        assert b.lease("rollouts", 100, consumer="b")[1] == []
        time.sleep(0.4)
        _, back = b.lease("rollouts", 100, consumer="b", ttl=60)
        assert [s.shard_id for s in back] == all_ids[1:3], "expired unacked shards return; acked ones never"
        assert a.ack(held[1:], consumer="a") == 0, "a lost its lease: its late ack must not count"
        assert b.ack(back, consumer="b") == 2


@pytest.mark.parametrize("same", ["rollout_id", "group_id"])
def test_racing_appenders_of_the_same_ids(buffer_dir, monkeypatch, same):
    """Both pass validation (the race); the manifest's keys let exactly one commit."""
    import rollstore.storage.buffer
    from rollstore import storage
    from rollstore.storage.validate import validate_rollouts

    table = rollouts_table(n_groups=2, group_size=4)
    other = table
    if same == "group_id":  # new rollout ids, same groups
        other = table.set_column(0, "rollout_id", [[f"{r}-b" for r in table.column(0).to_pylist()]])
    with Buffer.open(buffer_dir) as first, Buffer.open(buffer_dir) as second:
        first.append_rollouts(table, source="first.jsonl")
        # the second appender validated before the first committed: it saw no existing ids
        monkeypatch.setattr(storage.buffer, "validate_rollouts", lambda t, f, existing: validate_rollouts(t, f))
        with pytest.raises(ValidationError, match="already in the buffer") as info:
            second.append_rollouts(other, source="second.jsonl")
        assert info.value.file == "second.jsonl" and info.value.column == same
        assert first.snapshot().rows("rollouts") == 8
        live = {s.path for s in first.snapshot().shards("rollouts")}
    on_disk = {f"rollouts/{f}" for f in os.listdir(os.path.join(buffer_dir, "rollouts"))}
    assert on_disk == live, "the loser's file was left behind"
    assert os.listdir(os.path.join(buffer_dir, "tmp")) == []


def test_concurrent_appenders_threads(buffer_dir):
    """Threads appending distinct and overlapping groups: each id lands exactly once."""
    errors: list[BaseException] = []
    rejected: list[str] = []

    def append(worker: int) -> None:
        try:
            with Buffer.open(buffer_dir) as buf:
                for step in range(6):
                    # steps 0..2 are shared by both workers (same ids), 3..5 are their own
                    prefix = f"w{worker}-s{step}" if step >= 3 else f"shared-s{step}"
                    try:
                        buf.append_rollouts(rollouts_table(n_groups=2, group_size=4, step=step,
                                                           options=RowOptions(id_prefix=prefix)))
                    except ValidationError as exc:
                        rejected.append(str(exc))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=append, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert len(rejected) == 3
    with Buffer.open(buffer_dir) as buf:
        snap = buf.snapshot()
        with Session(snap) as s:
            n, distinct = s.execute("SELECT count(*), count(DISTINCT rollout_id) FROM rollouts").fetchone()
    assert n == distinct == 8 * (3 + 3 + 3)
