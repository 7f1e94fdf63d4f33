"""One generation step: prompts → sampled groups → rewards → scored rows in the rollouts schema.

Invariants:
- The returned table has exactly `storage.schema.ROLLOUTS`; with `score=True` (the default)
  `old_logprobs` and `entropies` are filled by one forward pass of the same weights: the
  sampler's own when the backend provides them (the in-process fp32 HF backend; see the backend
  contract), else a separate `learner.score` pass; with `score=False` they are null.
- Nothing is written anywhere: the caller appends the table through `storage` (the CLI does).
- Same model, prompts and arguments (seed included) give the same rows, except `created_at`.
- `meta` of each row records how it was sampled (backend, temperature, top_p, max_new_tokens, seed).

A loop should build its backend and `RewardPool` once and pass them in: without `backend`, each
call loads the model again, and without `reward_pool` each call starts (and stops) a pool of
verifier processes, about two seconds. `rollstore.loop.step.StepWriter` does that for the loop and the
generator process.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from rollstore.rollout.backends import Backend, get_backend
from rollstore.rollout.build import StepStamp, build_rollouts
from rollstore.rollout.prompt_sources import Prompt
from rollstore.rollout.reward import Overlong, RewardPool
from rollstore.storage.timing import Stopwatch


@dataclass(frozen=True)
class GenerationConfig:
    """How a step samples: the backend, `group_size` responses per prompt, the sampling knobs, the
    overlong penalty (`Overlong` or `(l_max, l_cache)`), and whether (and in batches of how many
    rows, on which device) to score the rows with the policy."""

    backend: str = "hf"
    group_size: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    overlong: Overlong | tuple[int, int] | None = None
    score: bool = True
    score_batch_size: int = 64
    device: str = "cpu"


def generate_step(
    model_dir: str,
    prompts: list[Prompt],
    stamp: StepStamp,
    config: GenerationConfig = GenerationConfig(),
    *,
    backend: Backend | None = None,
    reward_pool: RewardPool | None = None,
    timings: dict[str, float] | None = None,
) -> pa.Table:
    """Sample `config.group_size` responses per prompt, judge them, score them; return the rollouts table.

    `backend`: a loaded one (default: `config.backend` loaded from `model_dir`). `timings`, when
    given, gets the seconds of `generation`, `reward` and `scoring` added to it.
    """
    if not prompts:
        raise ValueError("generate_step needs at least one prompt")
    c = config
    clock = Stopwatch(timings)
    be = backend if backend is not None else get_backend(c.backend, model_dir, device=c.device)
    groups = be.generate([p.prompt for p in prompts], c.group_size, c.max_new_tokens, temperature=c.temperature,
                         top_p=c.top_p, seed=c.seed)
    flat = [g for group in groups for g in group]
    clock.lap("generation")

    overlong = Overlong(*c.overlong) if isinstance(c.overlong, tuple) else c.overlong
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
    if c.score and all(g.policy_logprobs is not None and g.entropies is not None for g in flat):
        old, ent = [g.policy_logprobs for g in flat], [g.entropies for g in flat]  # the sampler's own forward
    elif c.score:
        old, ent = _score(be, model_dir, c.device, flat, c.score_batch_size)
    clock.lap("scoring")
    sizes = [len(group) for group in groups]
    meta = {
        "backend": getattr(be, "name", type(be).__name__),
        "temperature": c.temperature,
        "top_p": c.top_p,
        "max_new_tokens": c.max_new_tokens,
        "seed": c.seed,
    }
    if overlong is not None:
        meta["overlong"] = {"l_max": overlong.l_max, "l_cache": overlong.l_cache}
    return build_rollouts(
        prompts,
        groups,
        _regroup(verdicts_flat, sizes),
        stamp,
        old_logprobs=None if old is None else _regroup(old, sizes),
        entropies=None if ent is None else _regroup(ent, sizes),
        meta=meta,
    )


def _score(be, model_dir: str, device: str, flat, batch_size: int):
    from rollstore.learner.policy_loading import load_policy
    from rollstore.learner.score import score as score_tokens

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
