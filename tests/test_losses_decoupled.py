"""The decoupled off-policy objective (docs/replay.md §Loss; AReaL arXiv 2505.24298) for every
registered loss: rows with no lag give exactly today's loss and gradient; lagged rows match a
brute-force numpy reference written from the formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstore.learner.losses import LOSSES, LossConfig, compute_loss

ALL = sorted(LOSSES)


def _tensors(seed: int, b: int = 4, t: int = 5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 2
    old = logp + (torch.rand(b, t, generator=g) - 0.5) * 0.6
    prox = logp + (torch.rand(b, t, generator=g) - 0.5) * 0.6
    gen = old + (torch.rand(b, t, generator=g) - 0.5) * 0.2
    mask = torch.rand(b, t, generator=g) > 0.25
    adv = torch.randn(b, generator=g)
    weights = torch.rand(b, generator=g) + 0.5
    return logp, old, prox, gen, mask, adv, weights


def _loss_and_grad(name, logp, old, mask, adv, weights, **kw):
    leaf = logp.clone().requires_grad_(True)
    out = compute_loss(name, leaf, old, mask, adv, weights, **kw)
    out.loss.backward()
    return out.loss.detach().double().item(), leaf.grad.clone()


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_without_lag_give_todays_loss_exactly(name, seed):
    """π_prox = π_old for a row with no lag: the loss and its gradient are today's (to 1e-7; in
    fact bit for bit), with or without the sampler-mismatch weight and the KL term."""
    logp, old, _, gen, mask, adv, weights = _tensors(seed)
    for config in (LossConfig(), LossConfig(tis_cap=2.0, dual_clip=3.0)):
        today = _loss_and_grad(name, logp, old, mask, adv, weights, gen_logp=gen,
                               config=LossConfig(**{**config.__dict__, "decoupled": False}))
        decoupled = _loss_and_grad(name, logp, old, mask, adv, weights, gen_logp=gen, prox_logp=old.clone(),
                                   config=config)
        assert abs(today[0] - decoupled[0]) <= 1e-7
        assert torch.allclose(today[1], decoupled[1], rtol=0, atol=1e-7)


def _reference(name, logp, old, prox, mask, adv, weights, clip_low, clip_high, cap):
    """Straight from the formula, in float64: ρ = π_θ/π_prox, w = min(π_prox/π_old, C),
    term = −w·min(ρA, clip(ρ)A); aggregated as the loss aggregates (docs/curation.md §Losses)."""
    logp, old, prox = (np.asarray(x, np.float64) for x in (logp, old, prox))
    mask, adv, weights = np.asarray(mask, bool), np.asarray(adv, np.float64), np.asarray(weights, np.float64)
    b, t = logp.shape
    n = mask.sum(axis=1)
    kept_rows = n > 0
    if name == "gspo":
        total = 0.0
        for i in range(b):
            if not n[i]:
                continue
            s = np.exp(sum(logp[i, j] - prox[i, j] for j in range(t) if mask[i, j]) / n[i])
            w = min(np.exp(sum(prox[i, j] - old[i, j] for j in range(t) if mask[i, j]) / n[i]), cap)
            a = adv[i]
            total += weights[i] * w * -min(s * a, np.clip(s, 1 - clip_low, 1 + clip_high) * a)
        return total / max(kept_rows.sum(), 1)
    per_token = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            if mask[i, j]:
                rho = np.exp(logp[i, j] - prox[i, j])
                w = min(np.exp(prox[i, j] - old[i, j]), cap)
                per_token[i, j] = w * -min(rho * adv[i], np.clip(rho, 1 - clip_low, 1 + clip_high) * adv[i])
    if name == "grpo":
        return sum(weights[i] * per_token[i].sum() / n[i] for i in range(b) if n[i]) / max(kept_rows.sum(), 1)
    if name == "dapo":
        return sum(weights[i] * per_token[i].sum() for i in range(b)) / max(n.sum(), 1)
    if name == "dr_grpo":
        longest = max((j + 1 for i in range(b) for j in range(t) if mask[i, j]), default=0)
        return sum(weights[i] * per_token[i].sum() for i in range(b)) / max(kept_rows.sum() * longest, 1)
    raise AssertionError(name)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cap=st.sampled_from([1.0, 1.5, 2.0, 10.0]),
       lagged=st.lists(st.booleans(), min_size=4, max_size=4))
def test_lagged_rows_match_the_numpy_reference(name, seed, cap, lagged):
    logp, old, prox, _, mask, adv, weights = _tensors(seed)
    rows = torch.tensor(lagged)
    prox = torch.where(rows[:, None], prox, old)  # what the trainer builds: π_prox only for lagged rows
    spec = LOSSES[name]
    clip_low, clip_high = (0.02, 0.03) if name == "gspo" else (spec.clip_low, spec.clip_high)
    out = compute_loss(name, logp, old, mask, adv, weights, prox_logp=prox,
                       config=LossConfig(decoupled_cap=cap, clip_low=clip_low, clip_high=clip_high))
    want = _reference(name, logp, old, prox, mask, adv, weights, clip_low, clip_high, cap)
    assert out.loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_the_weight_carries_no_gradient_and_the_ratio_is_against_prox():
    """d loss / d logπ at π_θ = π_prox is −w·A per token (no gradient through w or π_prox)."""
    logp = torch.tensor([[-1.0, -1.0]])
    old = torch.tensor([[-1.5, -0.5]])  # w = min(e^{0.5}, 2) = 1.6487, then e^{-0.5} = 0.6065
    leaf = logp.clone().requires_grad_(True)
    out = compute_loss("dapo", leaf, old, torch.tensor([[True, True]]), torch.tensor([1.0]), torch.tensor([1.0]),
                       prox_logp=logp.clone())
    out.loss.backward()
    w = torch.exp(logp - old).clamp(max=2.0)
    assert torch.allclose(leaf.grad, -w / 2, atol=1e-6)
    assert out.loss.item() == pytest.approx(float(-(w.sum()) / 2), rel=1e-6)
