"""Losses against hand-computed values (docs/curation.md §Losses)."""

from __future__ import annotations

import math

import pytest
import torch

from rollstore.learner.losses import LOSSES, LossConfig, Normalizer, compute_loss, get_loss

ALL = ("grpo", "dapo", "gspo", "dr_grpo")


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def run(name, logp, old, mask, adv, weights=None, **kw):
    adv = torch.tensor(adv, dtype=torch.float32)
    weights = torch.ones_like(adv) if weights is None else torch.tensor(weights, dtype=torch.float32)
    out = compute_loss(name, logp, torch.tensor(old, dtype=torch.float32), torch.tensor(mask), adv, weights, **kw)
    out.loss.backward()
    return out


def test_registry():
    assert set(LOSSES) == set(ALL)
    assert (LOSSES["grpo"].clip_low, LOSSES["grpo"].clip_high) == (0.2, 0.2)
    assert (LOSSES["dapo"].clip_low, LOSSES["dapo"].clip_high) == (0.2, 0.28)
    assert (LOSSES["gspo"].clip_low, LOSSES["gspo"].clip_high) == (3e-4, 4e-4)
    assert (LOSSES["dr_grpo"].clip_low, LOSSES["dr_grpo"].clip_high) == (0.2, 0.2)
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        get_loss("ppo")


def test_ratio_one_is_minus_advantage_and_its_gradient():
    logp = leaf([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])
    out = run("grpo", logp, logp.detach().tolist(), [[True] * 3] * 2, [1.0, -2.0])
    assert out.loss.item() == pytest.approx(-(1.0 - 2.0) / 2)  # mean_i −A_i
    # d/dlogp of −A·ρ at ρ = 1 is −A, divided by 3 tokens and 2 sequences
    expected = torch.tensor([[-1 / 6] * 3, [2 / 6] * 3])
    assert torch.allclose(logp.grad, expected)
    m = out.stats.metrics()
    assert m["clip_fraction"] == 0.0 and m["approx_kl"] == pytest.approx(0.0)
    assert (m["tokens"], m["samples"]) == (6, 2)


def test_clipped_on_both_sides():
    # one token per sequence: ratios 1.5, 1.5, 0.5, 0.5 against A = +1, −1, −1, +1
    logp = leaf([[math.log(1.5)], [math.log(1.5)], [math.log(0.5)], [math.log(0.5)]])
    out = run("grpo", logp, [[0.0]] * 4, [[True]] * 4, [1.0, -1.0, -1.0, 1.0])
    # −min(ρA, clip(ρ)A): −1.2 (clipped high), 1.5, 0.8 (clipped low), −0.5
    assert out.loss.item() == pytest.approx((-1.2 + 1.5 + 0.8 - 0.5) / 4)
    assert torch.allclose(logp.grad, torch.tensor([[0.0], [1.5 / 4], [0.0], [-0.5 / 4]]))
    assert out.stats.metrics()["clip_fraction"] == pytest.approx(0.5)
    # DAPO's higher upper clip: 1.28 instead of 1.2
    logp2 = leaf([[math.log(1.5)]])
    out2 = run("dapo", logp2, [[0.0]], [[True]], [1.0])
    assert out2.loss.item() == pytest.approx(-1.28)
    assert logp2.grad.item() == 0.0


def test_dual_clip_caps_negative_advantage_loss():
    ratio = 5.0
    logp = leaf([[math.log(ratio)]])
    plain = run("grpo", logp, [[0.0]], [[True]], [-1.0])
    assert plain.loss.item() == pytest.approx(5.0)  # −min(−5, −1.2) = 5, gradient flows
    assert logp.grad.item() == pytest.approx(5.0)
    logp = leaf([[math.log(ratio)]])
    dual = run("grpo", logp, [[0.0]], [[True]], [-1.0], config=LossConfig(dual_clip=3.0))
    assert dual.loss.item() == pytest.approx(3.0)  # capped at c·|A|
    assert logp.grad.item() == 0.0
    assert dual.stats.metrics()["clip_fraction"] == 1.0
    # dual clip never touches positive advantages
    logp = leaf([[math.log(ratio)]])
    pos = run("grpo", logp, [[0.0]], [[True]], [1.0], config=LossConfig(dual_clip=3.0))
    assert pos.loss.item() == pytest.approx(-1.2)


@pytest.mark.parametrize("name", ALL)
def test_masked_tokens_get_exactly_zero_gradient(name):
    mask = [[True, False, True, False], [False, True, False, False], [False] * 4]
    good = [[-1.0, 0.0, -0.5, 0.0], [0.0, -2.0, 0.0, 0.0], [0.0] * 4]
    old = [[-1.1, -math.inf, -0.4, -math.inf], [-math.inf, -2.05, -math.inf, -math.inf], [-math.inf] * 4]
    garbage = [[-1.0, 80.0, -0.5, -1e4], [1e4, -2.0, 55.0, -3.0], [7.0, -9.0, 1e3, 2.0]]
    logp = leaf(garbage)
    out = run(name, logp, old, mask, [1.5, -0.7, 3.0], ref_logp=torch.full((3, 4), -1.0),
              gen_logp=torch.full((3, 4), -1.2), config=LossConfig(kl_beta=0.1, tis_cap=2.0))
    assert torch.isfinite(out.loss)
    keep = torch.tensor(mask)
    assert torch.all(logp.grad[~keep] == 0.0)
    assert torch.all(logp.grad[keep] != 0.0)
    # the values at masked positions do not change the loss
    logp2 = leaf(good)
    out2 = run(name, logp2, old, mask, [1.5, -0.7, 3.0], ref_logp=torch.full((3, 4), -1.0),
               gen_logp=torch.full((3, 4), -1.2), config=LossConfig(kl_beta=0.1, tis_cap=2.0))
    assert out.loss.item() == out2.loss.item()
    assert out.stats.samples == 2 and out.stats.tokens == 3


def test_gspo_sequence_ratio():
    # sequence 0: log ratios 0.1, −0.3 → s = exp(−0.1), below 1 − 3e-4 with A > 0: unclipped
    # sequence 1: log ratios 0.01, 0.01 (third token masked) → s = exp(0.01) > 1 + 4e-4, A > 0: clipped
    old = [[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]]
    logp = leaf([[-0.9, -1.3, 5.0], [-1.99, -1.99, 3.0]])
    mask = [[True, True, False], [True, True, False]]
    out = run("gspo", logp, old, mask, [1.0, 2.0])
    s0 = math.exp(-0.1)
    assert out.loss.item() == pytest.approx((-s0 - 2.0 * (1 + 4e-4)) / 2, rel=1e-6)
    # ds0/dlogp_t = s0 / 2 (mean over 2 kept tokens); loss term −A·s0, averaged over 2 sequences
    expected = torch.tensor([[-s0 / 2 / 2, -s0 / 2 / 2, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    assert out.stats.metrics()["clip_fraction"] == pytest.approx(0.5)  # 2 of 4 kept tokens


def _aggregation_batch():
    # ratio 1 everywhere, so every kept token's loss is −A of its sequence
    mask = [[True, False, False, False], [True, True, True, False], [False] * 4]
    logp = leaf([[-1.0] * 4, [-1.0] * 4, [-1.0] * 4])
    return logp, [[-1.0] * 4] * 3, mask, [1.0, 2.0, 5.0]


@pytest.mark.parametrize(
    "name, expected, weighted",
    [
        ("grpo", (-1 - 2) / 2, (2 * -1 - 2) / 2),  # per-sequence token mean, then over 2 kept sequences
        ("dapo", (-1 - 6) / 4, (2 * -1 - 6) / 4),  # over the 4 kept tokens
        # / (2 sequences × longest response 3: the last kept position + 1, not the mask's width 4)
        ("dr_grpo", (-1 - 6) / (2 * 3), (2 * -1 - 6) / (2 * 3)),
        ("gspo", (-1 - 2) / 2, (2 * -1 - 2) / 2),  # one term per sequence, s = 1
    ],
)
def test_aggregation_modes_and_weights(name, expected, weighted):
    logp, old, mask, adv = _aggregation_batch()
    out = run(name, logp, old, mask, adv)
    assert out.loss.item() == pytest.approx(expected)
    assert out.stats.samples == 2  # the all-false sequence is skipped
    logp, old, mask, adv = _aggregation_batch()
    out = run(name, logp, old, mask, adv, weights=[2.0, 1.0, 7.0])
    assert out.loss.item() == pytest.approx(weighted)


def test_dr_grpo_constant_length():
    logp, old, mask, adv = _aggregation_batch()
    out = run("dr_grpo", logp, old, mask, adv, config=LossConfig(max_len=10))
    assert out.loss.item() == pytest.approx((-1 - 6) / (2 * 10))


def test_k3_kl_to_reference():
    logp = leaf([[-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.5]])
    out = run("grpo", logp, [[-1.0, -1.0]], [[True, True]], [0.0], ref_logp=ref, config=LossConfig(kl_beta=0.1))
    k3 = math.exp(-0.5) + 0.5 - 1
    assert out.loss.item() == pytest.approx(0.1 * k3)
    assert out.stats.metrics()["ref_kl"] == pytest.approx(k3)
    # d/dlogp [exp(ref − logp) − (ref − logp) − 1] = 1 − exp(ref − logp); token mean over 2
    assert torch.allclose(logp.grad, torch.full((1, 2), 0.1 * (1 - math.exp(-0.5)) / 2))
    # β = 0 (default): the KL is reported but not in the loss
    logp = leaf([[-1.0, -1.0]])
    out = run("grpo", logp, [[-1.0, -1.0]], [[True, True]], [0.0], ref_logp=ref)
    assert out.loss.item() == 0.0


def test_truncated_importance_weight():
    old = [[-1.0, -1.0]]
    gen = torch.tensor([[-1.0 - math.log(3.0), -1.0 - math.log(1.5)]])  # exp(old − gen) = 3, 1.5
    logp = leaf([[-1.0, -1.0]])
    out = run("dapo", logp, old, [[True, True]], [1.0], gen_logp=gen, config=LossConfig(tis_cap=2.0))
    assert out.loss.item() == pytest.approx((-2.0 - 1.5) / 2)  # min(3, C=2) and 1.5
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -0.75]]))
    # without a cap configured the sampler log-probs are ignored
    logp = leaf([[-1.0, -1.0]])
    out = run("dapo", logp, old, [[True, True]], [1.0], gen_logp=gen)
    assert out.loss.item() == pytest.approx(-1.0)


def test_approx_kl_and_entropy_metrics():
    logp = leaf([[math.log(1.5), 0.0, 0.0]])
    ent = torch.tensor([[0.5, 1.5, 100.0]])
    out = run("grpo", logp, [[0.0, 0.0, 0.0]], [[True, True, False]], [0.0], entropy=ent)
    m = out.stats.metrics()
    assert m["approx_kl"] == pytest.approx((0.5 - math.log(1.5)) / 2)  # (ρ − 1) − log ρ, mean over kept
    assert m["entropy"] == pytest.approx(1.0)


@pytest.mark.parametrize("name", ALL)
def test_micro_batches_with_step_normaliser_sum_to_full_batch(name):
    g = torch.Generator().manual_seed(0)
    b, t = 6, 5
    logp0 = -torch.rand(b, t, generator=g) * 2
    old = logp0 + (torch.rand(b, t, generator=g) - 0.5) * 0.6
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[4] = False
    adv = torch.randn(b, generator=g)
    w = torch.rand(b, generator=g) + 0.5
    lengths = torch.tensor([5, 3, 4, 5, 2, 1])
    full_logp = logp0.clone().requires_grad_(True)
    norm = Normalizer.of(mask, lengths)
    full = compute_loss(name, full_logp, old, mask, adv, w, norm=norm)
    full.loss.backward()
    parts_logp = logp0.clone().requires_grad_(True)
    total = 0.0
    for sl in (slice(0, 2), slice(2, 5), slice(5, 6)):
        out = compute_loss(name, parts_logp[sl], old[sl], mask[sl], adv[sl], w[sl], norm=norm)
        out.loss.backward()
        total += out.loss.item()
    assert total == pytest.approx(full.loss.item(), abs=1e-6)
    assert torch.allclose(parts_logp.grad, full_logp.grad, atol=1e-7)


def test_normalizer_without_lengths_takes_the_longest_response_not_the_mask_width():
    mask = torch.tensor([[True, False, True, False, False, False],
                         [True, True, False, False, False, False],
                         [False] * 6])
    norm = Normalizer.of(mask)
    assert (norm.sequences, norm.tokens, norm.max_len) == (2, 4, 3)  # last kept position + 1, not 6
    assert Normalizer.of(mask, torch.tensor([4, 2, 5])).max_len == 5  # lengths win when given
    assert Normalizer.of(torch.zeros(2, 4, dtype=torch.bool)).max_len == 0
    assert Normalizer.of(torch.zeros(0, 4, dtype=torch.bool)) == Normalizer(0, 0, 0)
