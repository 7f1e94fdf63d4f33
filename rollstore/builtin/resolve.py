"""Resolving model and prompt references for the application.

`resolve_model("builtin:tiny")` builds the tiny policy once — warm-started on the weak teacher's
demonstrations from `rollout.arith` by `learner.tiny.build_tiny`, until it reaches a target — and
caches it; `builtin:tiny-carries` is the same policy warm-started on `rollout.carries` (the harder
task `builtin:carries`); any existing directory is used as is.

Invariants:
- The cache key of `builtin:tiny` is what it was before the second task existed (no task name in
  it), so its cached builds stay valid; another task's key names the task.
- A cached tiny model lives in `$ROLLSTORE_CACHE/tiny-<key>` (default `~/.cache/rollstore`), where
  <key> hashes everything that determines its weights (architecture, tokenizer, warm-start schedule,
  steps, seed, number of examples, task version). Same key, same directory, built once.
- A cache entry appears only complete: it is built in a temporary sibling directory and renamed
  into place; a concurrent builder that loses the race discards its copy and uses the winner's.
- The warm start trains to a target, not for a fixed number of steps: every `WARM_CHECK_EVERY`
  steps it samples the dev prompts (held-out expressions outside the evaluation's first
  `HELDOUT_EVAL`) and stops once every level's sampled accuracy is at least its target, within
  `WarmStart.steps`: `WARM_TARGET` on builtin:arith, `WARM_FRACTION` of the weak teacher's own
  accuracy on each level of builtin:carries. Float kernels differ between CPUs, so the step it stops at may differ; the
  accuracy it stops at does not, beyond the granularity of one check.
- The package ships the default build of each built-in policy (rollstore.builtin.shipped): a first
  use whose key matches one copies and verifies it into the cache instead of building.
- Every built entry records its warm-start metrics, its checks, and held-out greedy and sampled
  accuracy per level in `rollstore_tiny.json`; unless `quiet`, one line on stderr says a build has
  started (it takes minutes) and a summary is printed there when it is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict

from rollstore.builtin import shipped as shipped_copies
from rollstore.builtin.shipped import TINY_INFO
from rollstore.storage.errors import RollstoreError

TINY_REF = "builtin:tiny"
ARITH_REF = "builtin:arith"
CARRIES_REF = "builtin:carries"
CHAINS_REF = "builtin:chains"
# built-in policies and prompt sources, by the task (a module of rollout/) they belong to
TINY_MODELS = {TINY_REF: "arith", "builtin:tiny-carries": "carries", "builtin:tiny-chains": "chains"}
TASK_PROMPTS = {ARITH_REF: "arith", CARRIES_REF: "carries", CHAINS_REF: "chains"}
TINY_BUILD_VERSION = 3  # bump when build_tiny or the arithmetic task changes what a key produces
DEFAULT_WARMUP_EXAMPLES = 20000
HELDOUT_EVAL = 500
WARM_TARGET = 0.20  # builtin:arith: every level's sampled dev accuracy at which the warm start stops
WARM_FRACTION = 2 / 3  # builtin:carries: the same, as a fraction of the teacher's accuracy on the level
# builtin:chains: the working must be learnt nearly exactly before RL, so the warm start stops later, and
# only on the levels the teacher mostly gets right (a level right 1 % of the time gives no usable check)
WARM_FRACTION_CHAINS = 0.9
WARM_CHAINS_MIN_TEACHER = 0.3
WARM_CHECK_EVERY = 100
WARM_DEV_PROMPTS = 240  # held-out prompts after the evaluation's first HELDOUT_EVAL
WARM_DEV_SAMPLES = 4


def cache_root() -> str:
    return os.environ.get("ROLLSTORE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rollstore")


def task_module(task: str):
    """The rollout module of a built-in task (`arith`, `carries`, `chains`)."""
    from rollstore.rollout import arith, carries, chains

    return {"arith": arith, "carries": carries, "chains": chains}[task]


def warm_targets(task: str) -> dict[int, float]:
    """Each level's sampled dev accuracy at which the warm start on `task` stops."""
    mod = task_module(task)
    if task == "arith":
        return {level: WARM_TARGET for level in mod.LEVELS}
    if task == "chains":
        accs = {level: mod.teacher_accuracy(level) for level in mod.LEVELS}
        return {level: round(WARM_FRACTION_CHAINS * a, 4) for level, a in accs.items() if a >= WARM_CHAINS_MIN_TEACHER}
    return {level: round(WARM_FRACTION * mod.teacher_accuracy(level), 4) for level in mod.LEVELS}


def task_model(prompts_ref: str) -> str | None:
    """The built-in policy meant for a built-in task's prompts (`builtin:carries` → builtin:tiny-carries), else None."""
    base = next((b for b in TASK_PROMPTS if prompts_ref == b or prompts_ref.startswith(b + ":")), None)
    if base is None:
        return None
    return next(ref for ref, task in TINY_MODELS.items() if task == TASK_PROMPTS[base])


def task_max_new_tokens(prompts_ref: str, default: int = 8) -> int:
    """The sampling budget a built-in task's responses need (`builtin:chains`: 40), else `default`."""
    base = next((b for b in TASK_PROMPTS if prompts_ref == b or prompts_ref.startswith(b + ":")), None)
    return default if base is None else task_module(TASK_PROMPTS[base]).MAX_NEW_TOKENS


def tiny_spec(steps: int | None = None, seed: int = 0, examples: int = DEFAULT_WARMUP_EXAMPLES,
              task: str = "arith") -> dict:
    """Everything that determines the weights of a built tiny policy (its cache key)."""
    from rollstore.learner.tiny import CHARS, SPECIALS, TinyConfig, WarmStart

    mod = task_module(task)
    schedule = WarmStart()
    target = {"accuracy": WARM_TARGET, "every": WARM_CHECK_EVERY, "dev": WARM_DEV_PROMPTS,
              "samples": WARM_DEV_SAMPLES}
    task_key = {"levels": mod.LEVELS, "slip": mod.TEACHER_SLIP, "heldout": mod.HELDOUT_PERCENT}
    if task != "arith":  # builtin:tiny's key stays what it was (module invariants)
        task_key["name"] = task
        target["accuracy"] = {str(k): v for k, v in warm_targets(task).items()}
    return {
        "version": TINY_BUILD_VERSION,
        "arch": asdict(TinyConfig()),
        "schedule": asdict(schedule),
        "steps": schedule.steps if steps is None else steps,
        "seed": seed,
        "examples": examples,
        "vocab": list(SPECIALS) + list(CHARS),
        "task": task_key,
        "target": target,
    }


def tiny_dir(spec: dict) -> str:
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), f"tiny-{key}")


def _complete(path: str) -> bool:
    return all(os.path.exists(os.path.join(path, f)) for f in ("config.json", "tokenizer.json", TINY_INFO))


def _right(task: str, text: str, gold: str) -> bool:
    """Whether a response states the gold result (the task's own reading of its result)."""
    return task_module(task).final_answer(text) == gold


def _per_level(prompts, gens, task: str = "arith") -> dict[str, float]:
    per: dict[int, list[bool]] = {}
    for p, group in zip(prompts, gens):
        per.setdefault(p.difficulty, []).extend(_right(task, g.text, p.gold_answer) for g in group)
    return {str(k): sum(v) / len(v) for k, v in sorted(per.items())}


def level_accuracy(backend, prompts, samples: int = 0, seed: int = 0, task: str = "arith") -> dict:
    """Greedy (and, with `samples`, sampled at T=1) exact-match accuracy per level on a built-in task's prompts."""
    texts = [p.prompt for p in prompts]
    budget = task_module(task).MAX_NEW_TOKENS
    greedy = backend.generate(texts, 1, budget, temperature=0.0)
    hits = sum(_right(task, g[0].text, p.gold_answer) for p, g in zip(prompts, greedy))
    per_level = _per_level(prompts, greedy, task)
    out = {"accuracy": hits / len(prompts), "level_mean": sum(per_level.values()) / len(per_level),
           "per_level": per_level, "n": len(prompts)}
    if samples:
        sampled = backend.generate(texts, samples, budget, temperature=1.0, seed=seed)
        out["sampled_per_level"] = _per_level(prompts, sampled, task)
        out["sampled"] = sum(_right(task, g.text, p.gold_answer) for p, gs in zip(prompts, sampled) for g in gs) / (
            samples * len(prompts))
    return out


def heldout_accuracy(model_dir: str, n: int = HELDOUT_EVAL, split: str = "train", samples: int = 8,
                     task: str = "arith") -> dict:
    """Greedy and sampled (T=1, `samples` per prompt) accuracy on the first n distinct held-out prompts.

    `accuracy` weighs every prompt equally; `level_mean` weighs every difficulty level equally;
    `per_level` / `sampled_per_level` have each level's.
    """
    from rollstore.rollout.backends.hf import HFBackend

    return level_accuracy(HFBackend(model_dir), task_module(task).heldout_prompts(n, split=split), samples, task=task)


def _target_check(checks: list[dict], task: str = "arith"):
    """The warm start's stop rule (module invariants): a callback for `build_tiny`."""
    from rollstore.learner.tiny import build_tokenizer
    from rollstore.rollout.backends.hf import HFBackend

    dev = task_module(task).heldout_prompts(HELDOUT_EVAL + WARM_DEV_PROMPTS)[HELDOUT_EVAL:]
    targets = warm_targets(task)
    tokenizer = build_tokenizer()

    def check(step: int, model) -> bool:
        if step % WARM_CHECK_EVERY:
            return False
        texts = [p.prompt for p in dev]
        gens = HFBackend.from_model(model, tokenizer).generate(texts, WARM_DEV_SAMPLES,
                                                                task_module(task).MAX_NEW_TOKENS, seed=step)
        model.train()
        per_level = _per_level(dev, gens, task)
        checks.append({"step": step, "sampled_per_level": per_level})
        return all(per_level[str(level)] >= t for level, t in targets.items())

    return check


def build_tiny_cached(steps: int | None = None, seed: int = 0, examples: int = DEFAULT_WARMUP_EXAMPLES,
                      quiet: bool = False, task: str = "arith", shipped: bool = True) -> str:
    """The cached tiny policy for these warm-start settings and task, built on first use.

    With `shipped`, a copy of this very key's build that the package carries (rollstore.builtin.shipped)
    is installed instead of building, once verified.
    """
    from rollstore.learner.tiny import build_tiny

    mod = task_module(task)
    ref = next(r for r, t in TINY_MODELS.items() if t == task)
    spec = tiny_spec(steps, seed, examples, task)
    final = tiny_dir(spec)
    if _complete(final):
        return final
    root = cache_root()
    os.makedirs(root, exist_ok=True)
    if shipped and shipped_copies.install(spec, final, ref):
        return final
    if not quiet:  # minutes of silence would look like a hang
        print(f"{ref}: building the built-in policy once (a warm start on {mod.SOURCE}, a few minutes "
              f"on a CPU); later runs reuse {final}", file=sys.stderr, flush=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-building-", dir=root)
    try:
        t0 = time.perf_counter()
        checks: list[dict] = []
        metrics = build_tiny(tmp, mod.warmup_examples(examples, seed), steps=spec["steps"], seed=seed,
                             callback=_target_check(checks, task) if steps is None else None)
        acc = heldout_accuracy(tmp, task=task)
        info = {"spec": spec, "warm_start": metrics, "checks": checks, "heldout": acc,
                "build_seconds": time.perf_counter() - t0}
        with open(os.path.join(tmp, TINY_INFO), "w") as fh:
            json.dump(info, fh, indent=2, sort_keys=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # lost a race with another builder
            return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not quiet:
        levels = ", ".join(f"L{k} {v:.0%}/{acc['sampled_per_level'][k]:.0%}" for k, v in acc["per_level"].items())
        print(
            f"{ref}: warm start {metrics['steps']} steps in {metrics['train_seconds']:.1f}s; held-out "
            f"greedy accuracy {acc['accuracy']:.1%}, sampled {acc['sampled']:.1%} of {acc['n']} distinct "
            f"prompts (greedy/sampled per level: {levels}) -> {final}",
            file=sys.stderr,
        )
    return final


def tiny_info(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, TINY_INFO)
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def _splits(task_ref: str) -> list[str]:
    """The splits a built-in task's reference may name (`builtin:arith:harder`): its training splits
    and their held-out ones."""
    names = list(task_module(TASK_PROMPTS[task_ref]).SPLITS)
    return names + ["heldout"] + [f"heldout-{n}" for n in names if n != "train"]


def check_refs(model: str | None = None, prompts: str | None = None) -> None:
    """Refuse a model or prompts reference that cannot resolve, at once, before anything slow (a
    model build or load) or anything written: a `builtin:` name that is not one (with a did-you-mean:
    `builtin:carry` -> `builtin:carries`), a directory or file that does not exist."""
    from rollstore.storage.errors import did_you_mean

    if model is not None and not model.startswith("checkpoint:"):
        if model.startswith("builtin:"):
            if model not in TINY_MODELS:
                raise RollstoreError(f"--model {model}: no such built-in policy{did_you_mean(model, TINY_MODELS)} "
                                     f"(built-in: {', '.join(TINY_MODELS)}; or a local model directory)")
        elif not os.path.isdir(model):
            raise RollstoreError(f"--model {model}: no such model directory (give a local model directory or one "
                                 f"of {', '.join(TINY_MODELS)})")
    if prompts is not None:
        if prompts.startswith("builtin:"):
            base = next((b for b in TASK_PROMPTS if prompts == b or prompts.startswith(b + ":")), None)
            splits = {b: _splits(b) for b in TASK_PROMPTS}
            known = list(TASK_PROMPTS) + [f"{b}:{s}" for b in TASK_PROMPTS for s in splits[b]]
            if base is None or (prompts != base and prompts.split(":", 2)[2] not in splits[base]):
                raise RollstoreError(f"--prompts {prompts}: no such built-in task{did_you_mean(prompts, known)} "
                                     f"(built-in: {', '.join(TASK_PROMPTS)}; or a JSONL/Parquet file)")
        elif not os.path.isfile(prompts):
            raise RollstoreError(f"--prompts {prompts}: no such file (a JSONL/Parquet file of prompts, or one of "
                                 f"{', '.join(TASK_PROMPTS)})")


def resolve_model(ref: str, *, steps: int | None = None, seed: int = 0, quiet: bool = False) -> str:
    """A local model directory for a built-in policy (built and cached) or an existing directory."""
    if ref in TINY_MODELS:
        return build_tiny_cached(steps=steps, seed=seed, quiet=quiet, task=TINY_MODELS[ref])
    if os.path.isdir(ref):
        if not os.path.exists(os.path.join(ref, "config.json")):
            raise RollstoreError(f"{ref}: not a transformers model directory (no config.json)")
        return os.path.abspath(ref)
    raise RollstoreError(f"{ref}: no such model directory (give a local model directory or one of "
                         f"{', '.join(TINY_MODELS)})")


def resolve_prompts(
    ref: str, n: int | None = None, seed: int = 0, split: str = "train", template: str | None = None
):
    """Prompts from a built-in task (`builtin:arith`, `builtin:carries`) or a JSONL/Parquet file.

    A built-in task: `split` is a task split (`train`, and `harder` for builtin:arith) for training
    prompts (n of them, deterministic by seed) or `heldout` / `heldout-harder` for the fixed held-out
    prompts; `builtin:arith:harder` names the split in the reference.
    A file: all its prompts, or n of them chosen by a seeded shuffle (cycling if n exceeds them).
    """
    from rollstore.rollout.datasets import load_prompts

    base = next((b for b in TASK_PROMPTS if ref == b or ref.startswith(b + ":")), None)
    if base is not None:
        task = task_module(TASK_PROMPTS[base])
        if ref != base:  # builtin:arith:harder; asked for its held-out prompts: heldout-harder
            named = ref.split(":", 2)[2]
            if split.startswith("heldout") and not named.startswith("heldout"):
                split = "heldout" if named == "train" else f"heldout-{named}"
            else:
                split = named
        n = 64 if n is None else n
        if split.startswith("heldout"):
            sub = split.split("-", 1)[1] if "-" in split else "train"
            return task.heldout_prompts(n, split=sub)
        return task.train_prompts(n, seed, split=split)
    prompts = load_prompts(ref, template=template)
    if n is None:
        return prompts
    order = list(range(len(prompts)))
    random.Random(f"prompts:{seed}").shuffle(order)
    return [prompts[order[i % len(order)]] for i in range(n)]
