"""Trainer-side scoring: per-token log-probs and entropies of given responses under a policy.

`score` is the one forward pass that fills `old_logprobs` and `entropies` of a rollout.

Invariants:
- Row i of the output has exactly len(response_token_ids[i]) float32 values; order of rows is the
  order of the input, whatever batching happens inside.
- Layout matches generation: prompts left-padded, responses right-padded, attention mask = prompt
  mask then response mask, position ids counted from each row's first real token. So the
  log-probs equal a sampler's temperature-1 log-probs of the same weights up to float rounding.
- log-prob of token t = log_softmax(logits)[t] at the position before it; entropy = −Σ p log p over
  the full vocabulary (nats) of that same distribution. Both in float32 from logits cast to float32;
  log-probs clamped to <= 0, entropies to >= 0.
- Memory stays bounded: one forward pass per micro-batch of `batch_size` rows gives hidden states,
  and the vocabulary projection + softmax run over `chunk` response positions at a time, so no
  [batch, positions, vocab] tensor larger than batch × chunk × vocab is ever built (except for
  models whose logits need the model's own head code; see `_needs_full_forward`).
"""

from __future__ import annotations

import numpy as np
import torch

_CHUNK_ELEMENTS = 1 << 24  # float32 elements per logits chunk when `chunk` is None (64 MiB)


def _pad_id(tokenizer_or_pad_id) -> int:
    if isinstance(tokenizer_or_pad_id, int):
        return tokenizer_or_pad_id
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer_or_pad_id, attr, None)
        if isinstance(value, int):
            return value
    return 0


def _needs_full_forward(model) -> bool:
    """Models whose logits are not just `lm_head(base_model(...).last_hidden_state)` (soft-capping,
    scaling, no separate base model): scored through their own forward, still chunked softmax."""
    cfg = model.config
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        value = getattr(cfg, attr, None)
        if value not in (None, 1, 1.0):
            return True
    return model.get_output_embeddings() is None or model.base_model is model


def _response_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and entropy for a [B, c, V] block of logits (float32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)
    return chosen, entropy


@torch.inference_mode()
def score(
    model,
    tokenizer_or_pad_id,
    prompt_token_ids: list[list[int]],
    response_token_ids: list[list[int]],
    batch_size: int = 64,
    chunk: int | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(old_logprobs, entropies) per row: float32 arrays as long as each response."""
    if len(prompt_token_ids) != len(response_token_ids):
        raise ValueError("prompt_token_ids and response_token_ids differ in length")
    n = len(prompt_token_ids)
    for i, p in enumerate(prompt_token_ids):
        if len(p) == 0:
            raise ValueError(f"row {i}: empty prompt (the first response token needs a context)")
    pad = _pad_id(tokenizer_or_pad_id)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    logprobs: list[np.ndarray] = [np.zeros(0, np.float32)] * n
    entropies: list[np.ndarray] = [np.zeros(0, np.float32)] * n
    # Longest rows first: less padding per micro-batch. Stable, so deterministic.
    order = sorted(range(n), key=lambda i: -(len(prompt_token_ids[i]) + len(response_token_ids[i])))
    try:
        for start in range(0, n, batch_size):
            rows = [i for i in order[start : start + batch_size] if len(response_token_ids[i])]
            if not rows:
                continue
            lp, ent = _score_batch(
                model, pad, device, [prompt_token_ids[i] for i in rows],
                [response_token_ids[i] for i in rows], chunk,
            )
            for r, i in enumerate(rows):
                m = len(response_token_ids[i])
                logprobs[i] = np.minimum(lp[r, :m], 0).astype(np.float32)
                entropies[i] = np.maximum(ent[r, :m], 0).astype(np.float32)
    finally:
        model.train(was_training)
    return logprobs, entropies


def _score_batch(model, pad, device, prompts, responses, chunk):
    B = len(prompts)
    P = max(len(p) for p in prompts)
    R = max(len(r) for r in responses)
    ids = torch.full((B, P + R), pad, dtype=torch.long)
    mask = torch.zeros((B, P + R), dtype=torch.long)
    targets = torch.full((B, R), 0, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        ids[b, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, P - len(p) : P + len(r)] = 1
        targets[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    ids, mask, position_ids, targets = (t.to(device) for t in (ids, mask, position_ids, targets))

    vocab = model.config.get_text_config().vocab_size
    step = chunk or max(1, _CHUNK_ELEMENTS // max(1, B * vocab))
    out_lp = torch.zeros((B, R), dtype=torch.float32)
    out_ent = torch.zeros((B, R), dtype=torch.float32)
    if _needs_full_forward(model):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        source = lambda s, e: logits[:, P - 1 + s : P - 1 + e]  # noqa: E731
    else:
        hidden = model.base_model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
        hidden = hidden.last_hidden_state[:, P - 1 : P - 1 + R]  # position P-1+t predicts token t
        head = model.get_output_embeddings()
        source = lambda s, e: head(hidden[:, s:e])  # noqa: E731
    for s in range(0, R, step):
        e = min(R, s + step)
        lp, ent = _response_stats(source(s, e), targets[:, s:e])
        out_lp[:, s:e] = lp.cpu()
        out_ent[:, s:e] = ent.cpu()
    return out_lp.numpy(), out_ent.numpy()
