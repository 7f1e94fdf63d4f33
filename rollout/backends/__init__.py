"""Generation backends behind one contract: prompts in, groups of sampled responses out.

Contract (every backend):
- `generate(prompts, group_size, max_new_tokens, temperature, top_p, seed)` returns one list per
  prompt, in prompt order, of `group_size` `Generation`s.
- `prompt_token_ids` are the tokenizer's ids for the prompt text (`load_tokenizer(model_dir)`,
  special tokens added as the tokenizer does by default), identical across backends.
- `response_token_ids` run up to and including the FIRST end-of-sequence token (`finish_reason`
  "stop"), or are the `max_new_tokens` sampled tokens when none was sampled ("length"). Whatever
  the engine produced after the first EOS (padding, more tokens) is dropped: masks are never built
  from `!= pad`, because a policy can sample the pad token mid-sequence.
- `gen_logprobs[t]` (float32, <= 0) is the log-probability of the sampled token t under
  log_softmax(logits / temperature) of the policy's logits at that position: temperature applied,
  top-p truncation NOT applied (no renormalisation over the nucleus). With temperature 1 it is the
  policy's own log-probability, the quantity `learner.score` recomputes. Temperature 0 means greedy
  decoding, and the log-probs are then taken at temperature 1.
- A backend whose sampling forward pass is the policy itself (the in-process HF backend, fp32)
  also fills `policy_logprobs` and `entropies`: log_softmax(logits) of the sampled token and the
  entropy of softmax(logits), temperature NOT applied, from that same forward pass; others leave
  them None and the caller scores the responses with a separate forward (`learner.score`).
- Same model, prompts, parameters and seed give the same generations (on the same machine).
- `load_weights(model_dir)` swaps in the weights of a new policy version between calls.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

BACKENDS = ("hf", "vllm")
FINISH_STOP, FINISH_LENGTH = "stop", "length"


@dataclass
class Generation:
    """One sampled response. `gen_logprobs` has one float32 per response token."""

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    text: str
    gen_logprobs: np.ndarray
    finish_reason: str
    policy_logprobs: np.ndarray | None = None  # untempered log-prob per token (see the contract)
    entropies: np.ndarray | None = None  # untempered entropy per position


class Backend(Protocol):
    name: str

    def generate(
        self,
        prompts: list[str],
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[list[Generation]]: ...

    def load_weights(self, model_dir: str) -> None: ...


def get_backend(name: str, model_dir: str, **kwargs) -> Backend:
    """Instantiate a backend by name ("hf" or "vllm") on a local model directory."""
    if name == "hf":
        from .hf import HFBackend

        return HFBackend(model_dir, **kwargs)
    if name == "vllm":
        from .vllm import VLLMBackend

        return VLLMBackend(model_dir, **kwargs)
    raise ValueError(f"unknown generation backend {name!r}; expected one of {', '.join(BACKENDS)}")


def load_tokenizer(model_dir: str):
    """The tokenizer of a local model directory, loaded the same way by every backend.

    A directory with a tokenizer.json is loaded with `PreTrainedTokenizerFast` directly, so a
    config's model_type can never swap in another tokenizer class (Qwen2's drops spaces).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    else:
        tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    return tok


def eos_token_ids(generation_config, tokenizer) -> list[int]:
    """Every id that ends a response: the model's generation-config EOS ids plus the tokenizer's."""
    ids: list[int] = []
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(eos, int):
        ids.append(eos)
    elif eos is not None:
        ids.extend(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    out = sorted(set(ids))
    if not out:
        raise ValueError("the model defines no end-of-sequence token")
    return out


def cut_at_first_eos(
    token_ids: list[int], logprobs: np.ndarray, eos_ids: list[int] | set[int], max_new_tokens: int
) -> tuple[list[int], np.ndarray, str]:
    """Keep tokens through the first EOS ("stop"), else the first max_new_tokens ("length")."""
    eos = set(eos_ids)
    for t, tok in enumerate(token_ids[:max_new_tokens]):
        if tok in eos:
            return list(token_ids[: t + 1]), logprobs[: t + 1], FINISH_STOP
    n = min(len(token_ids), max_new_tokens)
    return list(token_ids[:n]), logprobs[:n], FINISH_LENGTH


def check_sampling(group_size: int, max_new_tokens: int, temperature: float, top_p: float) -> None:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def finalize_logprobs(values) -> np.ndarray:
    """float32, clamped to <= 0 (a rounding excess above 0 is not a probability above 1)."""
    arr = np.asarray(values, dtype=np.float32)
    return np.minimum(arr, np.float32(0.0))
