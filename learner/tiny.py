"""The built-in policy `builtin:tiny`: a character-level Llama small enough to train on a CPU.

`build_tiny` makes a fresh model, warm-starts it by supervised learning on (prompt, answer) pairs
that the caller supplies (the application takes them from `rollout.arith`; learner never imports
rollout), and saves an ordinary transformers model directory that any backend can load.

Invariants:
- The tokenizer is a `tokenizers` WordLevel model over single characters (`CHARS`) plus four
  special tokens, wrapped in `PreTrainedTokenizerFast`; it adds `<bos>` in front of every text,
  decodes by plain concatenation, and saves and reloads exactly.
- The config is a Llama (`model_type: llama`, so AutoTokenizer never swaps in another class) with
  head_dim 64 (hidden 128, 2 heads): vLLM's CPU backend rejects head_dim 16 and runs 64.
- Training is deterministic by seed on a given machine, whatever the thread count: the model is
  initialised under `torch.manual_seed(seed)` inside `fork_rng` (the caller's RNG is untouched),
  batches come from a generator seeded with `seed`, and there is no dropout.
- The loss covers the answer characters and the end-of-sequence token only, so the policy learns
  to stop; prompts are never trained on.
- The output directory gets config.json, generation_config.json (neutral: no sampling defaults),
  model.safetensors, tokenizer.json and tokenizer_config.json, and nothing half-written: the caller
  is expected to build into a temporary directory and rename (rollstore.builtin.resolve does).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
CHARS = "0123456789+-*/=()., "


@dataclass(frozen=True)
class TinyConfig:
    """Architecture of the tiny policy (part of the cache key of a built model)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 64


@dataclass(frozen=True)
class WarmStart:
    """Supervised warm-start schedule (part of the cache key of a built model).

    `steps` is a cap: the application stops the default build earlier, at a target accuracy
    (`rollstore.builtin.resolve`), which on `builtin:arith` takes about a thousand steps (~40 s on one thread).
    """

    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 20
    final_lr_fraction: float = 0.1  # cosine decay from lr to lr * this over the steps
    weight_decay: float = 0.0


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer: specials get ids 0..3, then one id per character of CHARS."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=TinyConfig().max_position_embeddings,
    )


def tiny_model_config(tokenizer: PreTrainedTokenizerFast, arch: TinyConfig = TinyConfig()) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_key_value_heads=arch.num_attention_heads,
        tie_word_embeddings=False,
        **asdict(arch),
    )


def _encode_examples(
    tokenizer: PreTrainedTokenizerFast, examples: list[tuple[str, str]], max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask, labels (-100 outside answer + eos), right-padded to one length."""
    prompts = tokenizer([p for p, _ in examples])["input_ids"]  # <bos> + prompt characters
    answers = tokenizer([a for _, a in examples], add_special_tokens=False)["input_ids"]
    rows, label_rows = [], []
    for i, (p, a) in enumerate(zip(prompts, answers)):
        a = a + [tokenizer.eos_token_id]
        if len(p) + len(a) > max_len:
            raise ValueError(f"warm-start example {i} is {len(p) + len(a)} tokens, over {max_len}")
        rows.append(p + a)
        label_rows.append([-100] * len(p) + a)
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), tokenizer.pad_token_id, dtype=np.int64)
    labels = np.full((len(rows), width), -100, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, (r, lab) in enumerate(zip(rows, label_rows)):
        ids[i, : len(r)] = r
        labels[i, : len(lab)] = lab
        mask[i, : len(r)] = 1
    ids, mask, labels = torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(labels)
    return ids, mask, labels


def _lr_factor(step: int, steps: int, schedule: WarmStart) -> float:
    """Linear warm-up, then cosine decay to `final_lr_fraction` at the last step."""
    warm = max(1, schedule.warmup_steps)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    floor = schedule.final_lr_fraction
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_tiny(
    out_dir: str,
    examples: list[tuple[str, str]],
    steps: int | None = None,
    seed: int = 0,
    arch: TinyConfig = TinyConfig(),
    schedule: WarmStart = WarmStart(),
    log_every: int = 0,
    callback: Callable[[int, LlamaForCausalLM], bool | None] | None = None,
    threads: int | None = 1,
) -> dict:
    """Build, warm-start on `examples` and save the tiny policy into `out_dir`; return metrics.

    `steps` overrides `schedule.steps` (0 saves the untrained initialisation); it is a cap when
    `callback(step, model)` returns True to stop early (training to a target). Batches are drawn
    with replacement from `examples`, so any number of examples works. `threads` caps torch's
    intra-op threads during training (restored afterwards): at this model size one thread is
    nearly as fast as two on an idle machine, and an order of magnitude faster on a busy one,
    where OpenMP threads spin against other processes. None leaves torch's setting alone.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _build(out_dir, examples, steps, seed, arch, schedule, log_every, callback)
    finally:
        torch.set_num_threads(previous)


def _build(out_dir, examples, steps, seed, arch, schedule, log_every, callback) -> dict:
    """build_tiny's body, run under the chosen thread count."""
    if not examples:
        raise ValueError("build_tiny needs at least one (prompt, answer) example")
    steps = schedule.steps if steps is None else steps
    t0 = time.perf_counter()
    tokenizer = build_tokenizer()
    config = tiny_model_config(tokenizer, arch)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    ids, mask, labels = _encode_examples(tokenizer, examples, arch.max_position_embeddings)
    opt = torch.optim.AdamW(
        model.parameters(), lr=schedule.lr, weight_decay=schedule.weight_decay, betas=(0.9, 0.98)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, steps, schedule))
    model.train()
    loss_value = float("nan")
    done = 0
    for step in range(steps):
        idx = torch.randint(len(examples), (schedule.batch_size,), generator=gen)
        m = mask[idx]
        width = int(m.sum(dim=1).max())
        out = model(input_ids=ids[idx, :width], attention_mask=m[:, :width], labels=labels[idx, :width])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(out.loss.detach())
        if log_every and (step + 1) % log_every == 0:
            print(f"  warm start step {step + 1}/{steps} loss {loss_value:.4f}", file=sys.stderr, flush=True)
        done = step + 1
        if callback is not None and callback(done, model):  # e.g. an evaluation; must restore model.train()
            break
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {
        "steps": done,
        "max_steps": steps,
        "seed": seed,
        "final_loss": loss_value,
        "train_seconds": time.perf_counter() - t0,
        "parameters": sum(p.numel() for p in model.parameters()),
        "examples": len(examples),
    }
