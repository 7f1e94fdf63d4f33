"""`rollstore eval`: pass@k (unbiased) and avg@n of a model on a prompt set, judged by math-verify."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from rollstore.learner.passk import summarize
from rollstore.loop.generate import GenerationConfig


def evaluate(model_dir: str, prompts, samples: int, ks: list[int], temperature: float, max_new_tokens: int,
             seed: int, backend="hf") -> dict:
    from rollstore.rollout.backends import get_backend
    from rollstore.rollout.reward import RewardPool

    be = get_backend(backend, model_dir) if isinstance(backend, str) else backend
    gens = be.generate([p.prompt for p in prompts], samples, max_new_tokens, temperature=temperature, seed=seed)
    with RewardPool() as pool:
        golds = [p.gold_answer for p, g in zip(prompts, gens) for _ in g]
        flat = [x for g in gens for x in g]
        verdicts = pool.rewards(golds, [x.text for x in flat], [len(x.response_token_ids) for x in flat], None)
    correct, i = [], 0
    for g in gens:
        correct.append([verdicts[i + j].correct for j in range(len(g))])
        i += len(g)
    return summarize(correct, [k for k in ks if k <= samples])


def run_eval(model: str, prompts_ref: str, num_prompts: int | None, config: GenerationConfig, ks: list[int],
             buffer: str | None, fmt: str, out: Console) -> dict:
    """pass@k and avg@n of `config.group_size` samples per prompt (at `config.temperature`, up to
    `config.max_new_tokens` tokens, seeded by `config.seed`); printed, and recorded in `buffer` if given."""
    from rollstore.builtin.resolve import check_refs, resolve_model, resolve_prompts

    check_refs(model, prompts_ref)  # a misspelt built-in name is refused before a model is built or loaded
    samples, temperature, seed = config.group_size, config.temperature, config.seed

    if any(k > samples for k in ks):
        from rollstore.storage.errors import RollstoreError

        raise RollstoreError(f"pass@{max(ks)} needs --samples ≥ {max(ks)}")
    model_dir = resolve_model(model)
    prompts = resolve_prompts(prompts_ref, num_prompts, seed=seed, split="heldout")
    metrics = evaluate(model_dir, prompts, samples, ks, temperature, config.max_new_tokens, seed)
    if buffer:
        from rollstore.loop.driver import record_eval
        from rollstore.storage.buffer import Buffer

        with Buffer.open(buffer) as buf:
            record_eval(buf, "eval", -1, -1, prompts_ref, metrics, len(prompts), samples)
    if fmt == "json":
        print(json.dumps({"model": model_dir, "problems": len(prompts), "samples": samples, **metrics}))
    else:
        t = Table(title=f"{model} on {prompts_ref}: {len(prompts)} problems × {samples} samples (T={temperature})")
        t.add_column("metric")
        t.add_column("value", justify="right")
        for k, v in metrics.items():
            t.add_row(k, f"{v:.4f}")
        out.print(t)
    return metrics
