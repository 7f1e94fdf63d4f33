"""The learner's loader and trainer on a tiny random Llama, from curated shards in a buffer."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rollstore.learner.batches import collate, iter_steps, read_curated
from rollstore.learner.config import TrainConfig
from rollstore.learner.trainer import make_optimizer, response_logprobs, train_on_curation
from learner_util import commit_curated, curated_rows, one_thread, tiny_llama
from rollstore.storage.buffer import Buffer
from rollstore.storage.schema import TRAINING

_threads = pytest.fixture(autouse=True)(one_thread)


@pytest.fixture
def buf(buffer_dir):
    b = Buffer.open(buffer_dir)
    yield b
    b.close()


def paths(buf, rel):
    return [os.path.join(buf.root, p) for p in rel]


def test_logprobs_use_the_logits_of_the_previous_position():
    model = tiny_llama(0).eval()
    table = curated_rows("c", 5, seed=1)
    batch = collate(table)
    with torch.no_grad():
        logp, entropy = response_logprobs(model, batch)
        for i, row in enumerate(table.to_pylist()):
            prompt, response = row["prompt_token_ids"], row["response_token_ids"]
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
            lp = torch.log_softmax(logits.float(), dim=-1)
            for t, tok in enumerate(response):
                pos = len(prompt) + t - 1  # the logits that predict response token t
                assert logp[i, t].item() == pytest.approx(lp[pos, tok].item(), abs=1e-5)
                h = -(lp[pos].exp() * lp[pos]).sum().item()
                assert entropy[i, t].item() == pytest.approx(h, abs=1e-5)


def test_collate_pads_and_places_response_tokens():
    table = curated_rows("c", 3, seed=2)
    b = collate(table, pad_id=0)
    for i, row in enumerate(table.to_pylist()):
        lp, lr = len(row["prompt_token_ids"]), len(row["response_token_ids"])
        assert b.input_ids[i, :lp].tolist() == row["prompt_token_ids"]
        assert b.input_ids[i, b.positions[i, :lr]].tolist() == row["response_token_ids"]
        assert b.attention_mask[i].sum().item() == lp + lr
        assert b.response_mask[i].sum().item() == lr == b.lengths[i].item()
        assert b.loss_mask[i, :lr].tolist() == row["loss_mask"] and not b.loss_mask[i, lr:].any()
        assert b.old_logprobs[i, lr:].eq(0).all()
    assert b.input_ids.shape[1] == max(len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in table.to_pylist())


def test_steps_cover_every_row_once_in_a_deterministic_order():
    table = curated_rows("c", 11, seed=3)
    steps = list(iter_steps(table, micro_batch_size=2, grad_accum=2))
    assert [[len(b) for b in s] for s in steps] == [[2, 2], [2, 2], [2, 1]]
    ids = [r for s in steps for b in s for r in b.rollout_ids]
    assert ids == table.column("rollout_id").to_pylist()
    a = [r for s in iter_steps(table, 3, 1, shuffle_seed=7) for b in s for r in b.rollout_ids]
    b = [r for s in iter_steps(table, 3, 1, shuffle_seed=7) for b in s for r in b.rollout_ids]
    c = [r for s in iter_steps(table, 3, 1, shuffle_seed=7, epoch=1) for b in s for r in b.rollout_ids]
    assert a == b and sorted(a) == sorted(ids) and a != ids and c != a


def test_reader_names_the_file_row_and_column_of_a_bad_length(tmp_path):
    table = curated_rows("c", 3, seed=4).to_pylist()
    table[1]["loss_mask"] = table[1]["loss_mask"] + [True]
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.Table.from_pylist(table, schema=curated_rows("c", 1, 0).schema), path)
    with pytest.raises(ValueError, match=r"bad.parquet: row rollout_id='c-r001': column 'loss_mask'"):
        read_curated([path])


def _mean_logp(model, table, sign):
    batch = collate(table)
    with torch.no_grad():
        logp, _ = response_logprobs(model.eval(), batch)
    keep = batch.loss_mask & (torch.sign(batch.advantage)[:, None] == sign)
    return logp[keep].mean().item()


@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo", "dr_grpo"])
def test_training_raises_positive_and_lowers_negative_tokens(buf, loss):
    model = tiny_llama(0)
    table = curated_rows("cur1", 16, seed=5, model=model, empty_rows=2)
    shard = paths(buf, commit_curated(buf, "cur1", [table]))
    pos0, neg0 = _mean_logp(model, table, 1), _mean_logp(model, table, -1)
    opt, sched = make_optimizer(model, lr=3e-3, warmup_steps=2)
    rows = train_on_curation(
        model, opt, sched, shard, TrainConfig(loss=loss, epochs=4, micro_batch_size=4, grad_accum=2),
        run_id="r", version=1,
    )
    assert _mean_logp(model, table, 1) > pos0 + 0.05
    assert _mean_logp(model, table, -1) < neg0 - 0.05
    if loss != "gspo":  # GSPO's 3e-4 clip stops the loss within a step or two
        assert rows[-1]["loss"] < rows[0]["loss"]
    # one row per optimiser step, in the training table's schema
    pa.Table.from_pylist(rows, schema=TRAINING)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert {r["curation_id"] for r in rows} == {"cur1"} and {r["version"] for r in rows} == {1}
    kept = sum(sum(m) for m in table.column("loss_mask").to_pylist())
    assert sum(r["tokens"] for r in rows) == 4 * kept
    assert sum(r["samples"] for r in rows) == 4 * 14  # the two all-false rows are not counted
    assert rows[0]["lr"] == pytest.approx(1.5e-3) and rows[1]["lr"] == pytest.approx(3e-3)  # warm-up
    assert rows[0]["clip_fraction"] == 0.0 and rows[0]["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["grad_norm"] > 0 and all(r["entropy"] > 0 for r in rows)


def _train(table_paths, micro, accum, loss="dapo", sgd=False):
    model = tiny_llama(1)
    if sgd:  # the update is the gradient itself (Adam's first step is ±lr: a sign test of noise)
        opt, sched = torch.optim.SGD(model.parameters(), lr=1.0), None
    else:
        opt, sched = make_optimizer(model, lr=1e-3)
    rows = train_on_curation(model, opt, sched, table_paths, TrainConfig(loss=loss, micro_batch_size=micro,
                                                                          grad_accum=accum))
    return model, rows


@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo", "dr_grpo"])
def test_gradient_accumulation_equals_the_full_batch(buf, loss):
    shard = paths(buf, commit_curated(buf, "c", [curated_rows("c", 6, seed=6, model=tiny_llama(1))]))
    a, rows_a = _train(shard, 2, 3, loss, sgd=True)
    b, rows_b = _train(shard, 6, 1, loss, sgd=True)
    assert [r["loss"] for r in rows_a] == pytest.approx([r["loss"] for r in rows_b], abs=1e-6)
    for (name, pa_), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(pa_, pb, atol=1e-6), name


def test_training_is_deterministic_on_cpu(buf):
    shard = paths(buf, commit_curated(buf, "c", [curated_rows("c", 8, seed=7, model=tiny_llama(1))]))
    a, _ = _train(shard, 4, 1)
    b, _ = _train(shard, 4, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_step_without_kept_tokens_changes_nothing(buf):
    table = curated_rows("c", 4, seed=8, empty_rows=4)
    shard = paths(buf, commit_curated(buf, "c", [table]))
    model = tiny_llama(2)
    before = [p.detach().clone() for p in model.parameters()]
    opt, sched = make_optimizer(model, lr=1e-2)
    rows = train_on_curation(model, opt, sched, shard, TrainConfig(micro_batch_size=4))
    assert len(rows) == 1 and rows[0]["tokens"] == 0 and rows[0]["samples"] == 0
    assert all(torch.equal(x, y) for x, y in zip(before, model.parameters()))
    assert sched.last_epoch == 0


def _lagged(table: pa.Table, lagged_rows: set[int], version: int) -> pa.Table:
    """`table` with rows `lagged_rows` sampled at `version` − 1 (the others at `version`)."""
    versions = [version - 1 if i in lagged_rows else version for i in range(table.num_rows)]
    col = table.schema.get_field_index("policy_version")
    return table.set_column(col, table.schema.field(col), pa.array(versions, pa.int64()))


def test_decoupled_training_without_lag_is_todays_training_bit_for_bit(buf):
    """Every row sampled by the weights' own version: the decoupled objective changes nothing
    (same weights, torch.equal), and no proximal forward runs."""
    from rollstore.learner.losses import LossConfig

    shard = paths(buf, commit_curated(buf, "c", [_lagged(curated_rows("c", 8, seed=9, model=tiny_llama(1)), set(), 0)]))
    models = []
    for decoupled in (False, True):
        model = tiny_llama(1)
        opt, sched = make_optimizer(model, lr=1e-2)
        train_on_curation(model, opt, sched, shard, TrainConfig(micro_batch_size=4,
                                                                loss_config=LossConfig(decoupled=decoupled)),
                          version=1, weights_version=0)
        models.append(model)
    assert all(torch.equal(x, y) for x, y in zip(models[0].parameters(), models[1].parameters()))


def test_lagged_rows_are_scored_by_the_weights_at_the_start_of_the_step(buf, monkeypatch):
    """Only lagged rows go through the proximal forward, once per optimiser step, before its first
    backward; the loss then sees π_prox for them and π_old for the others."""
    import rollstore.learner.trainer as trainer
    from rollstore.learner.losses import LOSSES

    table = _lagged(curated_rows("c", 8, seed=10, model=tiny_llama(1)), {1, 4, 6}, 3)
    shard = paths(buf, commit_curated(buf, "c", [table]))
    model = tiny_llama(2)  # not the model that wrote old_logprobs: π_prox ≠ π_old
    seen, prox_rows = [], []
    original = trainer.proximal_logprobs

    def spy(m, batch, current, whole=False):
        out = original(m, batch, current, whole)
        lagged = batch.policy_version < current
        prox_rows.append(sorted(r for r, lag in zip(batch.rollout_ids, lagged.tolist()) if lag))
        with torch.no_grad():
            want, _ = response_logprobs(m, batch, with_entropy=False)
        assert torch.allclose(out[lagged], want[lagged], atol=1e-6)
        assert torch.equal(out[~lagged], batch.old_logprobs[~lagged])
        return out

    monkeypatch.setattr(trainer, "proximal_logprobs", spy)
    real = LOSSES["grpo"].fn

    def loss_spy(inputs, **kw):
        seen.append(inputs.prox_logp is not None)
        return real(inputs, **kw)

    monkeypatch.setattr(trainer, "get_loss", lambda name: loss_spy)
    opt, sched = make_optimizer(model, lr=1e-2)
    rows = train_on_curation(model, opt, sched, shard, TrainConfig(micro_batch_size=8), version=4, weights_version=3)
    assert len(rows) == 1 and all(seen)
    assert prox_rows == [["c-r001", "c-r004", "c-r006"]]
