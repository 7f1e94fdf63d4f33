"""The checkpoint index and checkpoint retention (learner/retention.py): listing by index, the newest K
versions keep their files, rows and the ledger stay, holds and replay windows are respected, a kill
changes nothing of exactly-once; gc retires many shards in one transaction."""

from __future__ import annotations

import os
import signal

import pyarrow as pa
import pytest
import torch

import rollstore.learner.checkpoint as checkpoint
from rollstore.learner import retention
from rollstore.learner.checkpoint import (
    CheckpointError,
    consumed_ledger,
    get_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from rollstore.learner.config import Pending, RunPosition, TrainConfig
from rollstore.learner.consume import pending_shards, resume, train_pending
from rollstore.learner.trainer import deterministic_cpu, make_optimizer
from rollstore.storage.buffer import Buffer
from rollstore.storage.maintenance import compact, gc
from learner_util import commit_curated, curated_rows, one_thread, tiny_llama
from test_checkpoint import fork, wait

_threads = pytest.fixture(autouse=True)(one_thread)

RUN = "run-r"
TRAIN = dict(loss="grpo", micro_batch_size=4, grad_accum=1, shuffle_seed=5, epochs=1)


def make_buffer(root: str, shards: int = 5) -> list[str]:
    """One curation of `shards` small curated shards (on-policy log-probs of tiny_llama(0))."""
    base = tiny_llama(0)
    with Buffer.init(root) as b:
        return commit_curated(b, "c1", [curated_rows("c1", 4, seed=20 + k, model=base) for k in range(shards)])


def learn(root: str, keep: int | None, die_after: int | None = None, window: int = 0) -> None:
    """Resume the run and train every pending shard (one checkpoint each), pruning to `keep`;
    `die_after`: SIGKILL right after publishing that version."""
    deterministic_cpu(0, threads=1)
    buf = Buffer.open(root)
    model = tiny_llama(0)
    opt, sched = make_optimizer(model, lr=3e-3, warmup_steps=2)
    version, step = resume(buf, model, opt, sched, RUN)
    if die_after is not None:
        import rollstore.learner.consume as consume

        real_save = consume.save_checkpoint

        def save(*a, **kw):
            ck = real_save(*a, **kw)
            if ck.version == die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            return ck

        consume.save_checkpoint = save
    train_pending(buf, model, opt, sched, TrainConfig(**TRAIN), at=RunPosition(RUN, version, step),
                  pending=Pending(per="shard"), retention=None if keep is None else (keep, window))
    buf.close()


def folders(root: str) -> list[str]:
    return sorted(os.listdir(os.path.join(root, "checkpoints")), key=lambda n: int(n[1:]))


def test_listing_and_the_newest_checkpoint_read_the_index_not_the_files(tmp_path, monkeypatch):
    root = str(tmp_path / "b")
    make_buffer(root, 3)
    learn(root, None)

    def no_file(*a, **kw):
        raise AssertionError("a checkpoint file was read")

    monkeypatch.setattr(checkpoint, "_rows_of_file", no_file)
    with Buffer.open(root) as b:
        assert [c.version for c in list_checkpoints(b)] == [1, 2, 3]
        assert latest_checkpoint(b, RUN).version == 3 and latest_checkpoint(b, "other") is None
        assert get_checkpoint(b, 2).parent_version == 1 and get_checkpoint(b, 9) is None
        assert len(consumed_ledger(b, 3)) == 3
        assert load_checkpoint(b, version=2).step > 0


def test_the_learners_pending_units_read_the_ledger_by_shard_not_every_checkpoint(tmp_path, monkeypatch):
    root = str(tmp_path / "b")
    shards = make_buffer(root, 3)
    learn(root, None)
    commit_curated(Buffer.open(root), "c2", [curated_rows("c2", 4, seed=60, model=tiny_llama(0))])

    def whole_ledger(*a, **kw):
        raise AssertionError("the whole ledger was read")

    with Buffer.open(root) as b:  # a resumed learner (its resume reads its lineage's ledger once) ...
        model = tiny_llama(0)
        opt, sched = make_optimizer(model, lr=3e-3, warmup_steps=2)
        version, step = resume(b, model, opt, sched, RUN)
        monkeypatch.setattr(checkpoint, "consumed_ledger", whole_ledger)  # ... then its units by shard
        cks = train_pending(b, model, opt, sched, TrainConfig(**TRAIN), at=RunPosition(RUN, version, step),
                            pending=Pending(["c2"], per="shard"))
        assert [c.version for c in cks] == [4]
        cks = train_pending(b, model, opt, sched, TrainConfig(**TRAIN), at=RunPosition(RUN, 4, cks[-1].step),
                            pending=Pending(per="shard"))
        assert cks == []  # every shard already in v4's lineage
    monkeypatch.undo()
    with Buffer.open(root) as b:
        ledger = [e["shard"] for e in consumed_ledger(b, 4)]
        assert ledger[:3] == shards and len(ledger) == 4 and len(set(ledger)) == 4
        assert checkpoint.consumed_in_lineage(b, 4, ledger + ["curated/x.parquet"]) == set(ledger)
        assert checkpoint.consumed_in_lineage(b, 2, ledger) == set(shards[:2])  # v2's lineage: v1, v2


def test_a_buffer_written_before_the_index_is_read_from_its_files_then_indexed(tmp_path):
    root = str(tmp_path / "b")
    shards = make_buffer(root, 3)
    learn(root, None)
    with Buffer.open(root) as b:  # as an older rollstore left it: no index
        with b.manifest.transaction() as con:
            con.execute("DROP TABLE checkpoint_index")
            con.execute("DROP TABLE consumed")
            con.execute("DELETE FROM meta WHERE key = 'checkpoints_indexed_through'")
        assert [c.version for c in list_checkpoints(b)] == [1, 2, 3]
        assert latest_checkpoint(b).version == 3
    commit_curated(Buffer.open(root), "c2", [curated_rows("c2", 4, seed=40, model=tiny_llama(0))])
    learn(root, None)  # its save indexes every older checkpoint in its commit
    with Buffer.open(root) as b:
        assert b.manifest.unindexed_checkpoints() == []
        cks = list_checkpoints(b)
        assert [(c.version, c.parent_version) for c in cks] == [(1, 0), (2, 1), (3, 2), (4, 3)]
        assert [e["shard"] for e in consumed_ledger(b, 4)][:3] == shards


def test_an_older_snapshot_still_sees_an_unindexed_checkpoint_retired_after_it(tmp_path):
    """The look-up of unindexed checkpoints skips the shards up to `checkpoints_indexed_through` (it
    does not read every checkpoint of a long run): one left unindexed there was retired before the
    marker was set, and a snapshot older than its retirement still finds it (by the removal index)."""
    root = str(tmp_path / "b")
    make_buffer(root, 3)
    learn(root, None)
    with Buffer.open(root) as b:
        first = b.manifest.shards("checkpoints")[0]
        with b.manifest.transaction() as con:  # as an older rollstore left it: v1 not indexed
            con.execute("DELETE FROM checkpoint_index WHERE shard_id = ?", (first.shard_id,))
        before = b.manifest.latest_seq()
        from rollstore.storage.verify import retire

        retire(b.manifest, [first], "quarantine")  # v1's shard retired (not indexed: it was not live)
    commit_curated(Buffer.open(root), "c2", [curated_rows("c2", 4, seed=40, model=tiny_llama(0))])
    learn(root, None)  # its save indexes every live checkpoint and sets the marker past v1's shard
    with Buffer.open(root) as b:
        through = int(b.manifest.con.execute(
            "SELECT value FROM meta WHERE key = 'checkpoints_indexed_through'").fetchone()[0])
        assert through > first.shard_id and b.manifest.unindexed_checkpoints() == []
        assert b.manifest.unindexed_checkpoints(before) == [(first.shard_id, first.path)]
        assert b.manifest.unindexed_checkpoints(b.manifest.latest_seq()) == []


def test_keep_k_leaves_the_newest_k_folders_and_every_row(tmp_path):
    root = str(tmp_path / "b")
    shards = make_buffer(root, 5)
    learn(root, 2)
    assert folders(root) == ["v4", "v5"]
    with Buffer.open(root) as b:
        cks = list_checkpoints(b)
        assert [c.version for c in cks] == [1, 2, 3, 4, 5]  # rows, lineage and ledger stay
        assert [c.pruned_seq is not None for c in cks] == [True, True, True, False, False]
        assert [e["shard"] for e in consumed_ledger(b, 5)] == shards
        assert pending_shards(b, consumed_ledger(b, 5)) == []
        assert latest_checkpoint(b).version == 5 and load_checkpoint(b).version == 5
        with pytest.raises(CheckpointError, match=r"v2's files were pruned"):
            load_checkpoint(b, version=2)
        training = b.snapshot().arrow("training").to_table()
        assert sorted(training.column("step").to_pylist()) == list(range(1, training.num_rows + 1))


def test_a_kill_after_a_pruning_publish_resumes_exactly_once(tmp_path):
    ref = str(tmp_path / "ref")
    shards = make_buffer(ref, 5)
    learn(ref, None)
    root = str(tmp_path / "b")
    assert make_buffer(root, 5) == shards
    status = wait(fork(learn, root, 2, 3))
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert folders(root) == ["v2", "v3"]  # v1's files went with v3's publish
    status = wait(fork(learn, root, 2))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert folders(root) == ["v4", "v5"]
    from safetensors.torch import load_file

    with Buffer.open(ref) as a, Buffer.open(root) as b:
        assert [(c.version, c.parent_version) for c in list_checkpoints(b)] == \
            [(c.version, c.parent_version) for c in list_checkpoints(a)]
        assert [e["shard"] for e in consumed_ledger(b, 5)] == shards  # each shard once, in order
        got = load_file(os.path.join(root, "checkpoints/v5/model.safetensors"))
        want = load_file(os.path.join(ref, "checkpoints/v5/model.safetensors"))
        assert all(torch.equal(got[k], want[k]) for k in want)  # as if never killed (bit-exact on CPU)


def test_a_following_learners_hold_keeps_its_version_and_refuses_an_explicit_prune(tmp_path, cli):
    root = str(tmp_path / "b")
    make_buffer(root, 3)
    learn(root, None)
    with Buffer.open(root) as b:
        retention.hold(b, "learner x", 2)
    make_more = [curated_rows("c2", 4, seed=50 + k, model=tiny_llama(0)) for k in range(2)]
    commit_curated(Buffer.open(root), "c2", make_more)
    learn(root, 1)  # automatic pruning keeps what a follower holds
    assert folders(root) == ["v2", "v5"]
    res = cli("gc", root, "--keep-checkpoints", "1", "--grace", "0")
    assert res.code != 0
    assert "checkpoint v2 is held by learner x" in res.stderr and "nothing was pruned" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert folders(root) == ["v2", "v5"]
    with Buffer.open(root) as b:
        retention.release(b, "learner x")
    res = cli("gc", root, "--keep-checkpoints", "1", "--grace", "0")
    assert res.code == 0, res.stderr
    assert "pruned the files of 1 checkpoint versions (v2..v2)" in res.stdout
    assert folders(root) == ["v5"]


def test_a_replay_window_keeps_its_versions_and_refuses_a_smaller_explicit_k(tmp_path, cli):
    root = str(tmp_path / "b")
    make_buffer(root, 4)
    learn(root, 1, window=2)
    assert folders(root) == ["v2", "v3", "v4"]  # the window's W + 1 newest, though K = 1
    res = cli("gc", root, "--keep-checkpoints", "1", "--replay-window", "2")
    assert res.code != 0 and "v3 is needed by the replay window" in res.stderr
    assert folders(root) == ["v2", "v3", "v4"]
    with Buffer.open(root) as b:
        retention.tag(b, 2, "best")
        assert retention.prune_checkpoints(b, 1) == [3]  # the tagged one keeps its files
    gc(Buffer.open(root), 0)
    assert folders(root) == ["v2", "v4"]


@pytest.mark.parametrize("k", ["0", "-1", "x"])
def test_a_bad_keep_is_one_line_and_prunes_nothing(tmp_path, cli, k):
    root = str(tmp_path / "b")
    make_buffer(root, 2)
    learn(root, None)
    for command in (["gc", root], ["train", root], ["loop", root]):
        res = cli(*command, "--keep-checkpoints", k)
        assert res.code != 0 and "--keep-checkpoints" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    assert folders(root) == ["v1", "v2"]
    for bad in (0, -3, True, 1.5):
        with pytest.raises(retention.RetentionError, match="--keep-checkpoints"):
            retention.check_keep(bad)


def test_gc_retires_many_shards_in_one_transaction(buffer_dir):
    b = Buffer.open(buffer_dir)
    for k in range(40):
        b.append("selections", _selection(k))
    assert compact(b, "selections").merged_shards == 40
    calls = []
    real = b.manifest.transaction

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    b.manifest.transaction = counting
    r = gc(b, 0)
    assert r.retired_removed == 40 and len(calls) == 1
    assert b.manifest.con.execute("SELECT count(*) FROM shards WHERE removed_seq IS NOT NULL").fetchone()[0] == 0
    assert len(b.manifest.shards("selections")) == 1
    b.close()


def _selection(k: int) -> pa.Table:
    from rollstore.storage.schema import SELECTIONS as schema

    row = {f.name: _value(f.type, k) for f in schema}
    return pa.Table.from_pylist([row], schema=schema)


def _value(t: pa.DataType, k: int):
    if pa.types.is_string(t):
        return f"s{k}"
    if pa.types.is_integer(t):
        return k
    if pa.types.is_floating(t):
        return float(k)
    if pa.types.is_boolean(t):
        return False
    if pa.types.is_timestamp(t):
        import datetime as dt

        return dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    if pa.types.is_list(t):
        return []
    return None


class _Weights:
    """What save_checkpoint asks of a model (its weights written to a folder), without a model."""

    def save_pretrained(self, folder, safe_serialization=True):
        with open(os.path.join(folder, "weights.bin"), "wb") as f:
            f.write(b"w" * 1000)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_index_and_retention_on_both_catalogs(tmp_path, request, kind):
    from rollstore.learner.checkpoint import Publish, save_checkpoint

    root = str(tmp_path / "b")
    catalog = request.getfixturevalue("pg").fresh_dsn() if kind == "postgres" else None
    Buffer.init(root, catalog=catalog).close()
    with Buffer.open(root) as b:
        for v in range(1, 6):
            save_checkpoint(b, _Weights(), publish=Publish(v, RUN, [{"curation_id": "c", "shard": f"s{v}"}],
                                                           parent_version=v - 1, step=v, retention=(2, 0)))
        save_checkpoint(b, _Weights(), publish=Publish(6, "other", [{"curation_id": "c", "shard": "s1"}]))
        assert b.manifest.unindexed_checkpoints() == []
        assert [c.version for c in list_checkpoints(b, RUN)] == [1, 2, 3, 4, 5]
        assert latest_checkpoint(b, RUN).version == 5 and latest_checkpoint(b).version == 6
        assert [e["shard"] for e in consumed_ledger(b, 5)] == ["s1", "s2", "s3", "s4", "s5"]
        with pytest.raises(CheckpointError, match="already trained into v2"):
            save_checkpoint(b, _Weights(), publish=Publish(7, RUN, [{"curation_id": "c", "shard": "s2"}],
                                                           parent_version=5))
        with pytest.raises(CheckpointError, match="version 5 already exists"):
            save_checkpoint(b, _Weights(), publish=Publish(5, RUN, [{"curation_id": "c", "shard": "s9"}]))
        retention.hold(b, "learner y", 4)
        with pytest.raises(retention.RetentionError, match="v4 is held by learner y"):
            retention.prune_checkpoints(b, 1, run_id=RUN)
        retention.release(b, "learner y")
        assert retention.prune_checkpoints(b, 1, run_id=RUN) == [4]
        assert retention.prune_checkpoints(b, 1, run_id=RUN) == []  # nothing left: no commit
        r = gc(b, 0)
        assert r.checkpoints_removed == 1
    assert folders(root) == ["v5", "v6"]


def test_the_loop_keeps_k_checkpoint_folders_resumes_and_refuses_a_pruned_model(tmp_path, cli):
    root = str(tmp_path / "b")
    args = ["--keep-checkpoints", "2", "--prompts-per-iter", "8", "--group-size", "4", "--max-new-tokens", "8",
            "--eval-every", "0", "--pool-size", "64"]
    assert cli("loop", root, "--iterations", "4", *args).code == 0
    assert folders(root) == ["v3", "v4"]
    assert cli("loop", root, "--iterations", "5", *args).code == 0  # resumed from v4, which kept its files
    assert folders(root) == ["v4", "v5"]
    with Buffer.open(root) as b:
        assert [(c.version, c.parent_version) for c in list_checkpoints(b)] == [(v, v - 1) for v in range(1, 6)]
        assert len(consumed_ledger(b, 5)) == len({e["shard"] for e in consumed_ledger(b, 5)}) > 0
    res = cli("generate", root, "--model", "checkpoint:2", "--num-prompts", "2")
    assert res.code != 0 and "v2's files were pruned" in res.stderr
