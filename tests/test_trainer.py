"""The learner's loader and trainer on a tiny random Llama, from curated shards in a buffer."""

from __future__ import annotations

import os

import numpy as np
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
    assert [[len(b) for b in s] for s in list(iter_steps(table, 2, 2, pack=False))] == [[2, 2], [2, 2], [2, 1]]
    assert all(len(b) <= 2 for s in steps for b in s)
    stored = table.column("rollout_id").to_pylist()
    # the loader's order decides the steps; inside a step, packing sorts rows by trained length
    assert [sorted(r for b in s for r in b.rollout_ids) for s in steps] == [stored[0:4], stored[4:8], stored[8:]]
    whole = [r for s in iter_steps(table, 2, 2, pack=False) for b in s for r in b.rollout_ids]
    assert whole == stored
    ids = [r for s in steps for b in s for r in b.rollout_ids]
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


def _set_column(table: pa.Table, name: str, values: list) -> pa.Table:
    col = table.schema.get_field_index(name)
    return table.set_column(col, table.schema.field(col), pa.array(values, table.schema.field(col).type))


def _near_policy(model, n: int, seed: int, lagged: set[int], noise: float = 0.15) -> pa.Table:
    """n rows whose old log-probs are `model`'s own plus uniform noise (±`noise` per token: the
    step's ratios and weights mostly inside the clip, yet π_prox ≠ π_old), rows `lagged` sampled
    at version 2, the others at 3."""
    table = _lagged(curated_rows("c", n, seed=seed, model=model), lagged, 3)
    rng = np.random.default_rng(seed)
    old = [[x + float(rng.uniform(-noise, noise)) for x in row] for row in table.column("old_logprobs").to_pylist()]
    return _set_column(table, "old_logprobs", old)


class _Grads:
    """An SGD (lr 1) whose every step records the gradients it applies."""

    def __init__(self, model):
        self.opt = torch.optim.SGD(model.parameters(), lr=1.0)
        self.steps: list[list[torch.Tensor]] = []
        self.opt.register_step_pre_hook(
            lambda opt, args, kwargs: self.steps.append([p.grad.detach().clone() for p in model.parameters()]))


@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo", "dr_grpo"])
def test_a_step_with_lagged_rows_runs_no_forward_but_its_training_passes(buf, monkeypatch, loss):
    """π_prox of a lagged row is its training forward's log-probs, detached: an optimiser step of two
    micro-batches runs two forwards of the model, lagged rows or not; the loss sees those log-probs
    for the lagged rows, the stored old log-probs (as they are) for the others, and nothing (today's
    loss) for a micro-batch without a lagged row."""
    import rollstore.learner.trainer as trainer
    from rollstore.learner.losses import LOSSES

    table = _lagged(curated_rows("c", 8, seed=10, model=tiny_llama(1)), {1, 3}, 3)
    shard = paths(buf, commit_curated(buf, "c", [table]))
    model = tiny_llama(2)  # not the model that wrote old_logprobs: π_prox ≠ π_old
    forwards = []
    model.register_forward_hook(lambda module, args, out: forwards.append(torch.is_grad_enabled()))
    seen = []
    real = LOSSES[loss].fn

    def loss_spy(inputs, **kw):
        seen.append(inputs)
        return real(inputs, **kw)

    monkeypatch.setattr(trainer, "get_loss", lambda name: loss_spy)
    opt, sched = make_optimizer(model, lr=1e-2)
    rows = train_on_curation(model, opt, sched, shard, TrainConfig(loss=loss, micro_batch_size=4, grad_accum=2,
                                                                    pack=False),  # micro-batches in stored order
                             version=4, weights_version=3)
    assert len(rows) == 1 and forwards == [True, True]  # the two training passes, nothing else
    first, second = seen  # micro-batches rows 0-3 (1 and 3 lagged) and rows 4-7 (none)
    lag = torch.tensor([False, True, False, True])[:, None].expand_as(first.old_logp)
    assert first.prox_logp is not None and not first.prox_logp.requires_grad
    assert torch.equal(first.prox_logp[lag], first.logp.detach()[lag])
    assert torch.equal(first.prox_logp[~lag], first.old_logp[~lag])
    assert second.prox_logp is None


def _decoupled_reference(model, table: pa.Table, loss: str, clip: tuple[float, float], cap: float,
                         lagged: set[int]) -> list[torch.Tensor]:
    """The gradient of one optimiser step over all of `table`, written out from the formula
    (docs/replay.md) with π_prox from a separate no-grad forward of the weights at the start of the
    step: per token ρ = π_θ/π_prox, w = min(π_prox/π_old, C), term −w·min(ρA, clip(ρ)A), π_prox =
    π_old for the rows not in `lagged` (w = 1); grpo: token mean per row, mean over rows; gspo: one
    term per row with ρ and w the geometric means over its kept tokens."""
    model.zero_grad(set_to_none=True)
    batch = collate(table)
    with torch.no_grad():
        prox, _ = response_logprobs(model, batch, with_entropy=False)
    logp, _ = response_logprobs(model, batch, with_entropy=False)
    lag = torch.tensor([i in lagged for i in range(len(batch))])[:, None]
    old, mask = batch.old_logprobs.double(), batch.loss_mask
    prox = torch.where(lag, prox.double(), old)
    logp = logp.double()
    kept = mask.sum(1)
    adv, weight = batch.advantage.double(), batch.weight.double()
    zero = torch.zeros((), dtype=torch.float64)
    lo, hi = clip
    if loss == "gspo":
        s = torch.exp(torch.where(mask, logp - prox, zero).sum(1) / kept)
        w = torch.clamp(torch.exp(torch.where(mask, prox - old, zero).sum(1) / kept), max=cap)
        per_row = -w * torch.minimum(s * adv, torch.clamp(s, 1 - lo, 1 + hi) * adv)
    else:  # grpo
        rho = torch.exp(logp - prox)
        w = torch.clamp(torch.exp(prox - old), max=cap)
        a = adv[:, None]
        term = -w * torch.minimum(rho * a, torch.clamp(rho, 1 - lo, 1 + hi) * a)
        per_row = torch.where(mask, term, zero).sum(1) / kept
    total = (weight * per_row)[kept > 0].sum() / (kept > 0).sum()
    total.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_the_update_with_lagged_rows_is_that_of_a_separate_proximal_forward(buf, loss):
    """The gradient a step applies equals the decoupled objective's gradient computed from the
    formula with π_prox from its own no-grad forward of the same weights (float32 sums over two
    micro-batches against one float64 batch: to 1e-6 of the largest entry), and differs from the
    gradient without the correction by far more (so the comparison can fail)."""
    from rollstore.learner.losses import LossConfig

    lagged, cap = {1, 4, 6}, 1.05  # a cap inside the noise: some weights are capped
    clip = (0.02, 0.03) if loss == "gspo" else (0.2, 0.2)  # GSPO's 3e-4 would cut every noisy row
    table = _near_policy(tiny_llama(2), 8, seed=11, lagged=lagged)
    shard = paths(buf, commit_curated(buf, "c", [table]))
    model = tiny_llama(2)
    grads = _Grads(model)
    config = TrainConfig(loss=loss, micro_batch_size=4, grad_accum=2, max_grad_norm=None,
                         loss_config=LossConfig(clip_low=clip[0], clip_high=clip[1], decoupled_cap=cap))
    train_on_curation(model, grads.opt, None, shard, config, version=4, weights_version=3)
    (got,) = grads.steps
    ref_model = tiny_llama(2)
    want = _decoupled_reference(ref_model, table, loss, clip, cap, lagged)
    plain = _decoupled_reference(ref_model, table, loss, clip, cap, set())
    scale = max(float(g.abs().max()) for g in want)
    worst = max(float((a - b.float()).abs().max()) for a, b in zip(got, want))
    apart = max(float((a - b).abs().max()) for a, b in zip(plain, want))
    assert worst <= 1e-6 * scale, (worst, scale)  # measured: ~1.5e-7 · scale
    assert apart > 100 * worst and apart > 1e-3 * scale, (apart, worst, scale)


@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo", "dr_grpo"])
def test_rows_without_lag_beside_lagged_ones_train_exactly_as_without_the_correction(buf, loss):
    """Lagged rows weighted 0 (they contribute exactly nothing): a step whose micro-batches mix them
    with rows of no lag applies, bit for bit, the update of the same step without the decoupled
    correction: the rows of no lag keep today's loss and gradient exactly."""
    from rollstore.learner.losses import LossConfig

    lagged = {1, 4, 6}
    table = _near_policy(tiny_llama(2), 8, seed=12, lagged=lagged)
    table = _set_column(table, "weight", [0.0 if i in lagged else 1.0 for i in range(8)])
    shard = paths(buf, commit_curated(buf, "c", [table]))
    models, applied = [], []
    for decoupled in (False, True):
        model = tiny_llama(2)
        grads = _Grads(model)
        train_on_curation(model, grads.opt, None, shard,
                          TrainConfig(loss=loss, micro_batch_size=4, grad_accum=2,
                                      loss_config=LossConfig(decoupled=decoupled)),
                          version=4, weights_version=3)
        models.append(model)
        applied.append(grads.steps[0])
    assert any(bool(g.abs().max() > 0) for g in applied[0])
    assert all(torch.equal(a, b) for a, b in zip(*applied))
    assert all(torch.equal(x, y) for x, y in zip(models[0].parameters(), models[1].parameters()))
