"""One generation step: prompts → sampled groups → rewards → scored rows in the rollouts schema.

Invariants:
- The returned table has exactly `storage.schema.ROLLOUTS`; with `score=True` (the default)
  `old_logprobs` and `entropies` are filled by one forward pass of the same weights: the
  sampler's own when the backend provides them (the in-process fp32 HF backend; see the backend
  contract), else a separate `learner.score` pass; with `score=False` they are null.
- Nothing is written anywhere: the caller appends the table through `storage` (the CLI does).
- Same model, prompts and arguments (seed included) give the same rows, except `created_at`.
- `meta` of each row records how it was sampled (backend, temperature, top_p, max_new_tokens, seed).

A loop should build its backend and `RewardPool` once and pass them in: given a backend name,
each call loads the model again, and without `reward_pool` each call starts (and stops) a pool of
verifier processes, about two seconds.
"""

from __future__ import annotations

from datetime import datetime

import pyarrow as pa

from rollout.backends import Backend, get_backend
from rollout.build import build_rollouts
from rollout.prompts import Prompt
from rollout.reward import Overlong, RewardPool
from storage.timing import Stopwatch


def generate_step(
    model_dir: str,
    prompts: list[Prompt],
    *,
    run_id: str,
    step: int,
    backend: str | Backend = "hf",
    group_size: int = 8,
    policy_version: int = 0,
    seed: int = 0,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    top_p: float = 1.0,
    overlong: Overlong | tuple[int, int] | None = None,
    score: bool = True,
    reward_pool: RewardPool | None = None,
    score_batch_size: int = 64,
    device: str = "cpu",
    created_at: datetime | None = None,
    prompt_offset: int = 0,
    timings: dict[str, float] | None = None,
) -> pa.Table:
    """Sample `group_size` responses per prompt, judge them, score them; return the rollouts table.

    `timings`, when given, gets the seconds of `generation`, `reward` and `scoring` added to it.
    """
    if not prompts:
        raise ValueError("generate_step needs at least one prompt")
    clock = Stopwatch(timings)
    be = get_backend(backend, model_dir, device=device) if isinstance(backend, str) else backend
    groups = be.generate(
        [p.prompt for p in prompts], group_size, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
    )
    flat = [g for group in groups for g in group]
    clock.lap("generation")

    if isinstance(overlong, tuple):
        overlong = Overlong(*overlong)
    golds = [p.gold_answer for p, group in zip(prompts, groups) for _ in group]
    pool = reward_pool or RewardPool()
    try:
        verdicts_flat = pool.rewards(
            golds, [g.text for g in flat], [len(g.response_token_ids) for g in flat], overlong
        )
    finally:
        if reward_pool is None:
            pool.close()
    clock.lap("reward")

    old = ent = None
    if score and all(g.policy_logprobs is not None and g.entropies is not None for g in flat):
        old, ent = [g.policy_logprobs for g in flat], [g.entropies for g in flat]  # the sampler's own forward
    elif score:
        old, ent = _score(be, model_dir, device, flat, score_batch_size)
    clock.lap("scoring")
    sizes = [len(group) for group in groups]
    meta = {
        "backend": getattr(be, "name", type(be).__name__),
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
    }
    if overlong is not None:
        meta["overlong"] = {"l_max": overlong.l_max, "l_cache": overlong.l_cache}
    return build_rollouts(
        prompts,
        groups,
        _regroup(verdicts_flat, sizes),
        run_id=run_id,
        step=step,
        policy_version=policy_version,
        old_logprobs=None if old is None else _regroup(old, sizes),
        entropies=None if ent is None else _regroup(ent, sizes),
        created_at=created_at,
        meta=meta,
        prompt_offset=prompt_offset,
    )


def _score(be, model_dir: str, device: str, flat, batch_size: int):
    from learner.models import load_policy
    from learner.score import score as score_tokens

    # The HF backend already holds these exact weights in memory; other backends load them again.
    if getattr(be, "name", None) == "hf" and getattr(be, "model_dir", None) == model_dir:
        model, tok = be.model, be.tokenizer
    else:
        model, tok = load_policy(model_dir, device=device)
    return score_tokens(
        model, tok, [g.prompt_token_ids for g in flat], [g.response_token_ids for g in flat], batch_size=batch_size
    )


def _regroup(items: list, sizes: list[int]) -> list[list]:
    out, k = [], 0
    for n in sizes:
        out.append(items[k : k + n])
        k += n
    return out
