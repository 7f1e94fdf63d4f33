"""Loading a policy for the learner: any local transformers causal-LM directory.

Invariants:
- A directory with tokenizer.json gets `PreTrainedTokenizerFast` directly (a config's model_type
  never swaps the tokenizer class), the same rule `rollout.backends.load_tokenizer` follows, so
  learner and sampler tokenize identically.
- The model is returned in eval mode on `device`, float32 on CPU unless a dtype is given.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast


def load_tokenizer(model_dir: str):
    if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    else:
        tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    return tok


def load_policy(model_dir: str, device: str = "cpu", dtype: torch.dtype | str | None = None):
    """(model, tokenizer) of a local model directory."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"{model_dir}: not a model directory")
    dev = torch.device(device)
    dtype = dtype or (torch.float32 if dev.type == "cpu" else "auto")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev).eval()
    return model, load_tokenizer(model_dir)
