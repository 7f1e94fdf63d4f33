"""Load a `TextCodec` from a local tokenizer directory (and optionally a scoring model).

Invariants:
- Only local directories are read (no network); transformers and torch are imported lazily, so
  the token formats that need no model never load torch.
- Encoding adds no special tokens: a dump's text is the model's text, templates included.
- `chat(messages)` renders a conversation with the tokenizer's own chat template and the generation
  prompt added (as TRL renders a conversational prompt), `chat_ids(messages)` tokenises it the way
  TRL does (`apply_chat_template(tokenize=True)`); both absent when the tokenizer has none.
  `encode_prompt(text)` adds the tokenizer's special tokens, as TRL's `processing_class(text=...)`
  does for a text prompt.
- `score(prompt_ids, response_ids)` returns one log-probability (<= 0) per response token, from the
  learner's scoring pass (`learner.score.score`, the pass that fills `old_logprobs` of generated
  rows) over the model in float32 on the CPU; the model loads on first use.
- A prompt with no tokens cannot be scored (nothing predicts the first response token): refused.
"""

from __future__ import annotations

import os

from .common import ImportRefused, TextCodec


def load_codec(tokenizer_dir: str | None, score_model_dir: str | None = None) -> TextCodec | None:
    if tokenizer_dir is None:
        if score_model_dir is not None:
            raise ImportRefused("--score-model needs --tokenizer DIR")
        return None
    if not os.path.isdir(tokenizer_dir):
        raise ImportRefused(f"--tokenizer {tokenizer_dir}: not a directory")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    def encode_prompt(text: str) -> list[int]:
        return list(tok(text)["input_ids"])

    chat = chat_ids = None
    if getattr(tok, "chat_template", None):
        def chat(messages: list[dict]) -> str:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

        def chat_ids(messages: list[dict]) -> list[int]:
            out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
            return list(out["input_ids"])

    score = None
    name = ""
    if score_model_dir is not None:
        if not os.path.isdir(score_model_dir):
            raise ImportRefused(f"--score-model {score_model_dir}: not a directory")
        score = _scorer(score_model_dir)
        name = os.path.basename(os.path.normpath(score_model_dir))
    return TextCodec(encode, decode, tok.eos_token_id, score, name, chat, encode_prompt, chat_ids)


def _scorer(model_dir: str):
    """A scoring function that loads the model on its first call (a refused import loads nothing);
    the log-probs come from the learner's own scoring pass (`learner.score.score`)."""
    held: dict = {}

    def load():
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # stderr carries only the one error line, if any
        return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)

    def score(prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        if not response_ids:
            return []
        if not prompt_ids:
            raise ImportRefused("--score-model: a row has an empty prompt; its first token cannot be scored")
        if "model" not in held:
            held["model"] = load()
        from rollstore.learner.score import score as score_rows

        logprobs, _ = score_rows(held["model"], 0, [list(prompt_ids)], [list(response_ids)], batch_size=1)
        return [float(v) for v in logprobs[0]]

    return score
