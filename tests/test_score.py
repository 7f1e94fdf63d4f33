"""learner.score: per-token log-probs and entropies against a direct computation from the logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollstore.learner import score as score_mod
from rollstore.learner.policy_loading import load_policy
from rollstore.learner.score import score
from rollout_helpers import untrained_tiny  # noqa: F401  (fixture)


def direct(model, prompt, response):
    """Unpadded single-row forward; log p and entropy in float64 straight from the logits."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    rows = logp[len(prompt) - 1 : len(prompt) - 1 + len(response)]
    chosen = rows[torch.arange(len(response)), torch.tensor(response)]
    entropy = -(rows.exp() * rows).sum(-1)
    return chosen.numpy(), entropy.numpy()


@pytest.fixture(scope="module")
def policy(untrained_tiny):  # noqa: F811
    return load_policy(untrained_tiny)


@pytest.fixture(scope="module")
def rows():
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(4, 24, size=int(n)).tolist() for n in rng.integers(1, 9, size=13)]
    responses = [rng.integers(0, 24, size=int(n)).tolist() for n in rng.integers(0, 11, size=13)]
    responses[3] = []  # an empty response scores to empty arrays
    return prompts, responses


def test_matches_direct_computation(policy, rows):
    model, tok = policy
    prompts, responses = rows
    lp, ent = score(model, tok, prompts, responses, batch_size=4)
    for p, r, a, h in zip(prompts, responses, lp, ent):
        assert a.dtype == np.float32 and h.dtype == np.float32 and len(a) == len(h) == len(r)
        if r:
            want_lp, want_h = direct(model, p, r)
            np.testing.assert_allclose(a, want_lp, atol=1e-5)
            np.testing.assert_allclose(h, want_h, atol=1e-5)
            assert (a <= 0).all() and (h >= 0).all()
            assert (h <= np.log(model.config.vocab_size) + 1e-5).all()


def test_batching_and_chunking_do_not_change_results(policy, rows, monkeypatch):
    model, tok = policy
    prompts, responses = rows
    ref_lp, ref_ent = score(model, tok.pad_token_id, prompts, responses, batch_size=64)
    widths = []
    real = score_mod._response_stats

    def spy(logits, targets):
        widths.append(logits.shape[1])
        return real(logits, targets)

    monkeypatch.setattr(score_mod, "_response_stats", spy)
    lp, ent = score(model, tok, prompts, responses, batch_size=3, chunk=2)
    assert widths and max(widths) <= 2  # never more than `chunk` positions of logits at once
    for a, b, c, d in zip(ref_lp, lp, ref_ent, ent):
        np.testing.assert_allclose(a, b, atol=2e-6)
        np.testing.assert_allclose(c, d, atol=2e-6)


def test_input_checks(policy):
    model, tok = policy
    with pytest.raises(ValueError, match="empty prompt"):
        score(model, tok, [[]], [[5]])
    with pytest.raises(ValueError, match="differ in length"):
        score(model, tok, [[1]], [])
    assert score(model, tok, [], []) == ([], [])
