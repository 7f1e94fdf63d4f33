"""Exactly-once checkpoints: publish/refuse rules, resume state, and the SIGKILL-and-resume test."""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
import warnings

import pytest
import torch

from rollstore.learner.checkpoint import (
    CheckpointError,
    Publish,
    append_training_metrics,
    consumed_entry,
    consumed_ledger,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from rollstore.learner.config import RunPosition, TrainConfig, TrainContext
from rollstore.learner.consume import pending_shards, resume, train_pending
from rollstore.learner.trainer import deterministic_cpu, make_optimizer, train_on_curation
from learner_util import commit_curated, curated_rows, one_thread, tiny_llama
from rollstore.storage.buffer import Buffer

_threads = pytest.fixture(autouse=True)(one_thread)

RUN = "run-1"


@pytest.fixture
def buf(buffer_dir):
    b = Buffer.open(buffer_dir)
    yield b
    b.close()


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{chr(97 + i): 3 + i for i in range(26)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def trained_one_step(buf, shard_rel):
    model = tiny_llama(0)
    opt, sched = make_optimizer(model, lr=1e-3, warmup_steps=4)
    rows = train_on_curation(model, opt, sched, [os.path.join(buf.root, p) for p in shard_rel],
                             TrainConfig(micro_batch_size=8))
    return model, opt, sched, rows


def test_save_then_load_restores_weights_optimizer_scheduler_and_rng(buf):
    rel = commit_curated(buf, "c1", [curated_rows("c1", 6, seed=1)])
    model, opt, sched, rows = trained_one_step(buf, rel)
    ck = save_checkpoint(buf, model, opt, sched, tokenizer=tiny_tokenizer(),
        publish=Publish(version=1, run_id=RUN, consumed=[consumed_entry("c1", rel[0])], parent_version=0, step=1,
                        metrics={"loss": rows[0]["loss"]}, training_rows=rows))
    expected_rand = torch.rand(3)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt", "ledger.json"):
        assert os.path.exists(os.path.join(ck.dir, name)), name
    assert ck.path == "checkpoints/v1" and not os.listdir(os.path.join(buf.root, "tmp"))

    other = tiny_llama(7)
    opt2, sched2 = make_optimizer(other, lr=1e-3, warmup_steps=4)
    torch.manual_seed(123)
    loaded = load_checkpoint(buf, other, opt2, sched2)
    assert (loaded.version, loaded.step, loaded.run_id, loaded.parent_version) == (1, 1, RUN, 0)
    assert loaded.ledger == [{"curation_id": "c1", "shard": rel[0]}] == loaded.consumed
    assert torch.equal(torch.rand(3), expected_rand)  # RNG state as it was at save time
    for (n, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for k in s1["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][key], s2["state"][k][key])
    assert sched2.last_epoch == sched.last_epoch == 1 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    # the row and the training metrics were published in the same commit
    snap = buf.snapshot()
    assert snap.rows("checkpoints") == 1 and snap.rows("training") == 1
    row = snap.arrow("checkpoints").to_table().to_pylist()[0]
    assert json.loads(row["consumed"]) == [{"curation_id": "c1", "shard": rel[0]}]


def test_a_version_is_published_once(buf):
    rel = commit_curated(buf, "c1", [curated_rows("c1", 4, seed=1), curated_rows("c1", 4, seed=2)])
    model, opt, sched, rows = trained_one_step(buf, rel[:1])
    save_checkpoint(buf, model, opt, sched,
        publish=Publish(version=1, run_id=RUN, consumed=[consumed_entry("c1", rel[0])]))
    before = open(os.path.join(buf.root, "checkpoints/v1/ledger.json")).read()
    with pytest.raises(CheckpointError, match="version 1 already exists"):
        save_checkpoint(buf, model, opt, sched,
            publish=Publish(version=1, run_id="another", consumed=[consumed_entry("c1", rel[1])],
                            training_rows=rows))
    snap = buf.snapshot()
    assert snap.rows("checkpoints") == 1 and snap.rows("training") == 0
    assert open(os.path.join(buf.root, "checkpoints/v1/ledger.json")).read() == before
    assert not os.listdir(os.path.join(buf.root, "tmp"))


def test_a_shard_is_trained_into_a_run_once(buf):
    rel = commit_curated(buf, "c1", [curated_rows("c1", 4, seed=1)])
    model, opt, sched, _ = trained_one_step(buf, rel)
    save_checkpoint(buf, model, opt, sched,
        publish=Publish(version=1, run_id=RUN, consumed=[consumed_entry("c1", rel[0])]))
    with pytest.raises(CheckpointError, match="already trained into v1"):
        save_checkpoint(buf, model, opt, sched,
            publish=Publish(version=2, run_id=RUN, consumed=[consumed_entry("c1", rel[0])], parent_version=1))
    assert not os.path.exists(os.path.join(buf.root, "checkpoints/v2"))
    # another run may train the same data
    save_checkpoint(buf, model, opt, sched,
        publish=Publish(version=2, run_id="run-2", consumed=[consumed_entry("c1", rel[0])], parent_version=0))
    assert [c.version for c in list_checkpoints(buf)] == [1, 2]
    assert latest_checkpoint(buf, RUN).version == 1
    # a curation's default current_version is per run: each run's newest checkpoint, read once per shard
    from rollstore.curate import steps
    from rollstore.queries.session import Session

    with buf.snapshot() as snap, Session(snap) as s:
        assert steps.checkpoint_versions(s) == {RUN: 1, "run-2": 2} == steps.checkpoint_versions(s)  # cached
        with Session(snap.frozen()) as frozen:  # a frozen snapshot (a Dask worker's) has no keys: the query
            assert not hasattr(frozen.snapshot, "shards") and steps.checkpoint_versions(frozen) == {RUN: 1, "run-2": 2}


def test_an_orphan_directory_of_a_crashed_save_is_replaced(buf):
    os.makedirs(os.path.join(buf.root, "checkpoints/v1"))
    with open(os.path.join(buf.root, "checkpoints/v1/model.safetensors"), "w") as fh:
        fh.write("half written")
    model = tiny_llama(0)
    save_checkpoint(buf, model, publish=Publish(version=1, run_id=RUN, consumed=[]))
    other = tiny_llama(3)
    load_checkpoint(buf, other)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert sorted(os.listdir(os.path.join(buf.root, "tmp"))) == []


def test_lease_is_acked_in_the_checkpoint_commit(buf):
    rel = commit_curated(buf, "c1", [curated_rows("c1", 4, seed=1), curated_rows("c1", 4, seed=2)])
    model = tiny_llama(0)
    _, leased = buf.lease("curated", 1, "learner-a", ttl=600)
    assert [s.path for s in leased] == rel[:1]
    save_checkpoint(buf, model,
        publish=Publish(version=1, run_id=RUN, consumed=[consumed_entry("c1", rel[0])],
                        lease=("learner-a", "default")))
    _, again = buf.lease("curated", 5, "learner-b")
    assert [s.path for s in again] == rel[1:]  # acked: never leased again; the other one is b's now
    with pytest.raises(CheckpointError, match="lease .* is not held by 'learner-a'"):
        save_checkpoint(buf, model,
            publish=Publish(version=2, run_id=RUN, consumed=[consumed_entry("c1", rel[1])],
                            lease=("learner-a", "default")))
    assert [c.version for c in list_checkpoints(buf)] == [1]


def test_training_metrics_and_ledger_along_the_lineage(buf):
    rel = commit_curated(buf, "c1", [curated_rows("c1", 4, seed=s) for s in (1, 2, 3)])
    model, opt, sched, rows = trained_one_step(buf, rel[:1])
    append_training_metrics(buf, rows)
    assert buf.snapshot().arrow("training").to_table().column("loss").to_pylist() == [rows[0]["loss"]]
    for v, shard in enumerate(rel, start=1):
        save_checkpoint(buf, model,
            publish=Publish(version=v, run_id=RUN, consumed=[consumed_entry("c1", shard)], parent_version=v - 1))
    assert [e["shard"] for e in consumed_ledger(buf, 3)] == rel
    assert [e["shard"] for e in consumed_ledger(buf, 2)] == rel[:2]
    assert pending_shards(buf, consumed_ledger(buf, 1)) == buf.manifest.shards("curated")[1:]


# ---- the kill test ----------------------------------------------------------------------------

CURATIONS = {"cA": [(6, 11), (6, 12)], "cB": [(5, 13), (6, 14)]}  # (rows, seed) per shard
TRAIN = dict(loss="grpo", micro_batch_size=2, grad_accum=2, shuffle_seed=5, epochs=1)


def make_buffer(root: str) -> list[str]:
    """A buffer with 2 curations × 2 curated shards (on-policy log-probs of tiny_llama(0))."""
    base = tiny_llama(0)
    with Buffer.init(root) as b:
        out = []
        for cid, shards in CURATIONS.items():
            out += commit_curated(b, cid, [curated_rows(cid, n, seed=s, model=base) for n, s in shards])
    return out


def learner_process(root: str, kill: str | None = None) -> None:
    """One learner process: resume the run from its latest checkpoint and train what is pending."""
    deterministic_cpu(0, threads=1)
    buf = Buffer.open(root)
    model = tiny_llama(0)
    opt, sched = make_optimizer(model, lr=3e-3, warmup_steps=3)
    version, step = resume(buf, model, opt, sched, RUN)

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    on_step = None
    if kill in ("first_step", "mid_shard"):
        at = 1 if kill == "first_step" else 3  # step 3 is the first of the second shard

        def on_step(row):
            if row["step"] == at:
                die()

    elif kill == "before_commit":  # the directory is in place, the manifest row not yet
        real_rename = os.rename

        def rename(src, dst):
            real_rename(src, dst)
            if str(dst).endswith("checkpoints/v2"):
                die()

        os.rename = rename
    elif kill == "after_commit":
        import rollstore.learner.consume as consume

        real_save = consume.save_checkpoint

        def save(*a, **kw):
            ck = real_save(*a, **kw)
            if ck.version == 2:
                die()
            return ck

        consume.save_checkpoint = save
    elif kill == "external":

        def on_step(row):
            time.sleep(0.2)  # v3 is >= 0.4 s after v2: the parent's SIGKILL lands before the end

    train_pending(buf, model, opt, sched, TrainConfig(**TRAIN), at=RunPosition(RUN, version, step),
                  context=TrainContext(on_step=on_step))
    buf.close()


def fork(fn, *args) -> int:
    """Run fn(*args) in a forked child (no re-import of torch/transformers); return its pid."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded process ... fork()"
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def wait(pid: int) -> int:
    return os.waitpid(pid, 0)[1]


def final_state(root: str):
    from safetensors.torch import load_file

    with Buffer.open(root) as b:
        cks = list_checkpoints(b)
        weights = load_file(os.path.join(b.root, cks[-1].path, "model.safetensors"))
        training = b.snapshot().arrow("training").to_table().sort_by("step").to_pylist()
    return cks, weights, training


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reference") / "buf")
    shards = make_buffer(root)
    status = wait(fork(learner_process, root, None))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    return shards, final_state(root)


@pytest.mark.parametrize("kill", ["first_step", "mid_shard", "before_commit", "after_commit", "external"])
def test_sigkill_then_resume_trains_every_shard_exactly_once(tmp_path, reference, kill):
    shards, (ref_cks, ref_weights, ref_training) = reference
    assert [c.version for c in ref_cks] == [1, 2, 3, 4]
    root = str(tmp_path / "buf")
    assert make_buffer(root) == shards
    pid = fork(learner_process, root, kill)
    if kill == "external":  # kill from outside once v2 is published, wherever the child then is
        with Buffer.open(root) as b:
            deadline = time.time() + 60
            while (latest_checkpoint(b) is None or latest_checkpoint(b).version < 2) and time.time() < deadline:
                time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
    status = wait(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    with Buffer.open(root) as b:
        published = [c.version for c in list_checkpoints(b)]
    expected = {"first_step": [], "mid_shard": [1], "before_commit": [1], "after_commit": [1, 2]}
    if kill == "external":
        assert 2 <= len(published) < 4  # it really died mid-run
    else:
        assert published == expected[kill]
    if kill == "before_commit":  # the orphan directory the resumed save must replace
        assert os.path.exists(os.path.join(root, "checkpoints/v2/model.safetensors"))

    status = wait(fork(learner_process, root, None))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0

    cks, weights, training = final_state(root)
    assert [(c.version, c.parent_version) for c in cks] == [(1, 0), (2, 1), (3, 2), (4, 3)]
    ledger = [e["shard"] for c in cks for e in c.consumed]
    assert ledger == shards  # every curated shard exactly once, in commit order
    assert [e["curation_id"] for c in cks for e in c.consumed] == ["cA", "cA", "cB", "cB"]
    assert [r["step"] for r in training] == list(range(1, 9))  # each step's metrics exactly once
    assert [r["loss"] for r in training] == [r["loss"] for r in ref_training]
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], ref_weights[name]), name  # bit-exact on CPU
    assert sorted(os.listdir(os.path.join(root, "checkpoints"))) == ["v1", "v2", "v3", "v4"]
    assert not [n for n in os.listdir(os.path.join(root, "tmp")) if n.startswith(("ckpt-", "orphan-"))]
    with Buffer.open(root) as b:
        assert pending_shards(b, consumed_ledger(b, 4)) == []
