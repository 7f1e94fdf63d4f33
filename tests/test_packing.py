"""The packed learner: a row trained on its prefix up to its last kept token, rows micro-batched by
length, rows with nothing kept not forwarded — the same loss and gradient as the whole rows with
their tails masked, for every registered loss, and fewer learner positions."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest
import torch

from rollstore.learner.batches import collate, iter_rank_steps, kept_extent
from rollstore.learner.config import TrainConfig
from rollstore.learner.losses import LOSSES
from rollstore.learner.parallel import passes, rank_micro
from rollstore.learner.trainer import train_on_curation
from learner_util import commit_curated, curated_rows, one_thread, tiny_llama
from rollstore.storage.buffer import Buffer

_threads = pytest.fixture(autouse=True)(one_thread)

RTOL, ATOL = 1e-5, 1e-6  # float32: the same sums over differently padded micro-batches


@pytest.fixture
def buf(buffer_dir):
    b = Buffer.open(buffer_dir)
    yield b
    b.close()


def _set(table: pa.Table, name: str, values) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))


def tailed(n: int = 12, seed: int = 0, keep_tails: bool = False) -> pa.Table:
    """n rows whose loss masks end early (a masked tail of 1+ tokens) in most rows, two rows with
    nothing kept (one of them the step's longest response: dr_grpo's normaliser must still see it),
    rows 1 and 5 lagged (sampled at version 2; the weights are at 3), old log-probs from another
    model (ratios ≠ 1: clipping and the decoupled weight both act). `keep_tails`: the same rows
    with every tail token kept (a different loss: the comparison below can fail)."""
    rng = np.random.default_rng(seed)
    table = curated_rows("c", n, seed=seed, model=tiny_llama(1), mask_fraction=0.7)
    prompts = table.column("prompt_token_ids").to_pylist()
    responses = table.column("response_token_ids").to_pylist()
    old = table.column("old_logprobs").to_pylist()
    masks = table.column("loss_mask").to_pylist()
    # the longest response of the table: 14 tokens, nothing kept
    responses[n - 1] = rng.integers(3, 32, 13).tolist() + [2]
    old[n - 1] = [-1.0] * 14
    for i, m in enumerate(masks):
        cut = int(rng.integers(1, len(m))) if len(m) > 1 and i % 4 != 3 else len(m)
        m = [bool(x) for x in m[:cut]] + [keep_tails] * (len(m) - cut)
        m[0] = True
        masks[i] = m
    masks[n - 1] = [False] * 14
    masks[n - 2] = [False] * len(masks[n - 2])
    table = _set(table, "response_token_ids", responses)
    table = _set(table, "old_logprobs", [[x + float(rng.uniform(-0.3, 0.3)) for x in row] for row in old])
    table = _set(table, "gen_logprobs", old)
    table = _set(table, "loss_mask", masks)
    table = _set(table, "advantage", rng.normal(size=n).tolist())
    table = _set(table, "weight", rng.uniform(0.5, 1.5, n).tolist())
    table = _set(table, "policy_version", [2 if i in (1, 5) else 3 for i in range(n)])
    assert all(p for p in prompts)
    return table


class _Grads:
    """An SGD (lr 1) whose every step records the gradients it applies."""

    def __init__(self, model):
        self.opt = torch.optim.SGD(model.parameters(), lr=1.0)
        self.steps: list[list[torch.Tensor]] = []
        self.opt.register_step_pre_hook(
            lambda opt, args, kwargs: self.steps.append([p.grad.detach().clone() for p in model.parameters()]))


def _step(shard, loss: str, pack: bool, micro: int, accum: int):
    model = tiny_llama(2)
    grads = _Grads(model)
    rows = train_on_curation(model, grads.opt, None, shard,
                             TrainConfig(loss=loss, micro_batch_size=micro, grad_accum=accum, max_grad_norm=None,
                                         pack=pack),
                             version=4, weights_version=3)
    assert len(rows) == 1 and len(grads.steps) == 1
    return rows[0], grads.steps[0]


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_trimmed_row_trains_as_the_whole_row_with_its_tail_masked(buf, loss):
    """One optimiser step over 12 rows: whole rows in one micro-batch (the reference) against rows
    trimmed after their last kept token in micro-batches of 3 sorted by length: the same loss and
    every parameter's gradient to float32 tolerance, for every registered loss. The same step with
    the tails kept moves the gradient by far more than the tolerance (the comparison can fail)."""
    table = tailed()
    shard = [os.path.join(buf.root, p) for p in commit_curated(buf, "c", [table])]
    whole_row, whole = _step(shard, loss, pack=False, micro=12, accum=1)
    packed_row, packed = _step(shard, loss, pack=True, micro=3, accum=4)
    assert packed_row["loss"] == pytest.approx(whole_row["loss"], rel=RTOL, abs=ATOL)
    for key in ("tokens", "samples"):
        assert packed_row[key] == whole_row[key]
    assert packed_row["entropy"] == pytest.approx(whole_row["entropy"], rel=RTOL)
    assert packed_row["approx_kl"] == pytest.approx(whole_row["approx_kl"], rel=RTOL, abs=ATOL)
    for (name, _), a, b in zip(tiny_llama(2).named_parameters(), packed, whole):
        assert torch.allclose(a, b, rtol=RTOL, atol=ATOL), (name, float((a - b).abs().max()))
    # what was forwarded: 10 trimmed rows in micro-batches of similar lengths, against 12 whole rows
    assert packed_row["positions"] < whole_row["positions"] == 12 * max(
        len(p) + len(r) for p, r in zip(table.column("prompt_token_ids").to_pylist(),
                                        table.column("response_token_ids").to_pylist()))
    kept_tails = [os.path.join(buf.root, p) for p in commit_curated(buf, "k", [tailed(keep_tails=True)])]
    _, other = _step(kept_tails, loss, pack=True, micro=3, accum=4)
    apart = max(float((a - b).abs().max()) for a, b in zip(other, whole))
    assert apart > 1e3 * ATOL, apart


def test_collate_trim_cuts_each_row_after_its_last_kept_token():
    table = tailed()
    kept, ends = kept_extent(table)
    masks = table.column("loss_mask").to_pylist()
    assert kept.tolist() == [sum(m) for m in masks]
    assert ends.tolist() == [max((t + 1 for t, x in enumerate(m) if x), default=0) for m in masks]
    b, whole = collate(table, trim=True), collate(table)
    assert b.lengths.tolist() == whole.lengths.tolist()  # full lengths: dr_grpo's normaliser
    assert b.response_mask.sum(1).tolist() == ends.tolist()
    assert b.input_ids.shape[1] < whole.input_ids.shape[1]
    for i, row in enumerate(table.to_pylist()):
        lp, e = len(row["prompt_token_ids"]), int(ends[i])
        n_in = lp + e - 1 if e else lp  # the last kept token predicts nothing: not an input
        assert b.input_ids[i, :n_in].tolist() == (row["prompt_token_ids"] + row["response_token_ids"])[:n_in]
        assert b.attention_mask[i].sum().item() == n_in
        assert b.response_ids[i, :e].tolist() == row["response_token_ids"][:e]
        assert b.positions[i, :e].tolist() == list(range(lp, lp + e))
        assert b.loss_mask[i, :e].tolist() == row["loss_mask"][:e]
        assert b.old_logprobs[i, :e].tolist() == pytest.approx(row["old_logprobs"][:e])


def test_length_buckets_bound_the_padding():
    from rollstore.learner.batches import length_buckets

    lengths = np.array([5, 5, 6, 6, 6, 7, 12, 12, 13, 30])
    chunks = length_buckets(np.arange(10), lengths, most=4)
    assert [c.tolist() for c in chunks] == [[0, 1, 2, 3], [4, 5], [6, 7, 8], [9]]
    for c in chunks:  # padding at most 1/8 of a micro-batch's positions
        assert len(c) * lengths[c].max() - lengths[c].sum() <= 0.125 * len(c) * lengths[c].max()
    assert [c.tolist() for c in length_buckets(np.arange(4), np.array([3, 3, 3, 3]), most=3)] == [[0, 1, 2], [3]]
    assert length_buckets(np.arange(0), np.array([], dtype=np.int64), most=3) == []


def test_a_step_is_micro_batched_by_length_and_dealt_to_ranks():
    table = tailed(n=16, seed=3)
    kept, ends = kept_extent(table)
    prompt = [len(p) for p in table.column("prompt_token_ids").to_pylist()]
    (step,) = list(iter_rank_steps(table, micro_batch_size=3, grad_accum=6))
    widths = [b.input_ids.shape[1] for b in step.micro]
    assert widths == sorted(widths)  # micro-batches of similar lengths, shortest first
    trained = [r for b in step.micro for r in b.rollout_ids]
    ids = table.column("rollout_id").to_pylist()
    assert sorted(trained) == sorted(ids[i] for i in range(16) if kept[i] > 0)  # nothing-kept rows not forwarded
    assert sum(b.positions_run for b in step.micro) < 16 * max(
        len(p) + len(r) for p, r in zip(table.column("prompt_token_ids").to_pylist(),
                                        table.column("response_token_ids").to_pylist()))
    # the step's denominators are the whole step's: every row's full length, kept tokens of all
    assert step.norm.tokens == int(kept.sum()) and step.norm.sequences == int((kept > 0).sum())
    assert step.norm.max_len == max(len(r) for r in table.column("response_token_ids").to_pylist())
    for b in step.micro:
        lens = [prompt[ids.index(r)] + int(ends[ids.index(r)]) - 1 for r in b.rollout_ids]
        assert b.input_ids.shape[1] == max(lens)
    # two ranks: disjoint shares covering the step, the same pass count and denominators on both
    n = len(step.micro)
    shares = [list(iter_rank_steps(table, 3, 6, rank=r, world=2))[0] for r in range(2)]
    assert sorted(r for s in shares for b in s.micro for r in b.rollout_ids) == sorted(trained)
    assert {s.passes for s in shares} == {passes(n, 2)} and {s.norm for s in shares} == {step.norm}
    assert [list(rank_micro(5, r, 2)) for r in range(2)] == [[0, 2, 4], [1, 3]]
    assert passes(5, 2) == 3 and passes(4, 2) == 2 and passes(0, 3) == 0


def test_the_packing_bench_trains_the_same_loss_with_fewer_positions(capsys):
    import re

    from bench import learner_packing

    assert learner_packing.main(["--rows", "24", "--hidden", "64", "--layers", "1", "--micro-batch", "4",
                                 "--repeat", "1"]) == 0
    runs = re.findall(r"pack=(\w+): \d+ steps, learner positions ([\d,]+), kept tokens ([\d,]+), [\d.]+ s, "
                      r"last loss (\S+)", capsys.readouterr().out)
    (_, whole, kept_w, loss_w), (_, packed, kept_p, loss_p) = runs
    assert kept_w == kept_p and abs(float(loss_w) - float(loss_p)) <= 1e-5 * max(1.0, abs(float(loss_w)))
    assert int(packed.replace(",", "")) < 0.8 * int(whole.replace(",", ""))
