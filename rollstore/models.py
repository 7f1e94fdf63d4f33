"""Resolving model and prompt references for the application.

`resolve_model("builtin:tiny")` builds the tiny policy once — warm-started on examples from
`rollout.arith` by `learner.tiny.build_tiny` — and caches it; any existing directory is used as is.

Invariants:
- A cached tiny model lives in `$ROLLSTORE_CACHE/tiny-<key>` (default `~/.cache/rollstore`), where
  <key> hashes everything that determines its weights (architecture, tokenizer, warm-start schedule,
  steps, seed, number of examples, task version). Same key, same directory, built once.
- A cache entry appears only complete: it is built in a temporary sibling directory and renamed
  into place; a concurrent builder that loses the race discards its copy and uses the winner's.
- Every built entry records its warm-start metrics and held-out greedy accuracy in
  `rollstore_tiny.json`, and the accuracy is printed to stderr when it is built.
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

from storage.errors import RollstoreError

TINY_REF = "builtin:tiny"
ARITH_REF = "builtin:arith"
TINY_INFO = "rollstore_tiny.json"
TINY_BUILD_VERSION = 2  # bump when build_tiny or the arithmetic task changes what a key produces
DEFAULT_WARMUP_EXAMPLES = 20000
HELDOUT_EVAL = 500


def cache_root() -> str:
    return os.environ.get("ROLLSTORE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rollstore")


def tiny_spec(steps: int | None = None, seed: int = 0, examples: int = DEFAULT_WARMUP_EXAMPLES) -> dict:
    """Everything that determines the weights of a built tiny policy (its cache key)."""
    from learner.tiny import CHARS, SPECIALS, TinyConfig, WarmStart
    from rollout import arith

    schedule = WarmStart()
    return {
        "version": TINY_BUILD_VERSION,
        "arch": asdict(TinyConfig()),
        "schedule": asdict(schedule),
        "steps": schedule.steps if steps is None else steps,
        "seed": seed,
        "examples": examples,
        "vocab": list(SPECIALS) + list(CHARS),
        "task": {str(k): asdict(v) for k, v in arith.LEVELS.items()},
    }


def tiny_dir(spec: dict) -> str:
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), f"tiny-{key}")


def _complete(path: str) -> bool:
    return all(os.path.exists(os.path.join(path, f)) for f in ("config.json", "tokenizer.json", TINY_INFO))


def heldout_accuracy(model_dir: str, n: int = HELDOUT_EVAL, split: str = "train") -> dict:
    """Greedy exact-match accuracy on the first n (distinct) held-out arithmetic prompts.

    `accuracy` weighs every prompt equally; `level_mean` weighs every difficulty level equally
    (the small levels 1 and 3 have only a few dozen held-out prompts); `per_level` has each level's.
    """
    from rollout import arith
    from rollout.backends.hf import HFBackend

    prompts = arith.heldout_prompts(n, split=split)
    backend = HFBackend(model_dir)
    gens = backend.generate([p.prompt for p in prompts], 1, 12, temperature=0.0)
    per: dict[int, list[bool]] = {}
    for p, g in zip(prompts, gens):
        per.setdefault(p.difficulty, []).append(g[0].text.strip() == p.gold_answer)
    hits = sum(sum(v) for v in per.values())
    per_level = {str(k): sum(v) / len(v) for k, v in sorted(per.items())}
    return {
        "accuracy": hits / len(prompts),
        "level_mean": sum(per_level.values()) / len(per_level),
        "per_level": per_level,
        "n": len(prompts),
    }


def build_tiny_cached(steps: int | None = None, seed: int = 0, examples: int = DEFAULT_WARMUP_EXAMPLES,
                      quiet: bool = False) -> str:
    """The cached tiny policy for these warm-start settings, built on first use."""
    from learner.tiny import build_tiny
    from rollout import arith

    spec = tiny_spec(steps, seed, examples)
    final = tiny_dir(spec)
    if _complete(final):
        return final
    root = cache_root()
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-building-", dir=root)
    try:
        t0 = time.perf_counter()
        metrics = build_tiny(tmp, arith.warmup_examples(examples, seed), steps=spec["steps"], seed=seed)
        acc = heldout_accuracy(tmp)
        info = {"spec": spec, "warm_start": metrics, "heldout": acc, "build_seconds": time.perf_counter() - t0}
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
        levels = ", ".join(f"L{k} {v:.0%}" for k, v in acc["per_level"].items())
        print(
            f"builtin:tiny: warm start {spec['steps']} steps in {metrics['train_seconds']:.1f}s; held-out "
            f"greedy accuracy {acc['accuracy']:.1%} of {acc['n']} distinct prompts, {acc['level_mean']:.1%} "
            f"averaged over levels ({levels}) -> {final}",
            file=sys.stderr,
        )
    return final


def tiny_info(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, TINY_INFO)
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def resolve_model(ref: str, *, steps: int | None = None, seed: int = 0, quiet: bool = False) -> str:
    """A local model directory for `builtin:tiny` (built and cached) or an existing directory."""
    if ref == TINY_REF:
        return build_tiny_cached(steps=steps, seed=seed, quiet=quiet)
    if os.path.isdir(ref):
        if not os.path.exists(os.path.join(ref, "config.json")):
            raise RollstoreError(f"{ref}: not a transformers model directory (no config.json)")
        return os.path.abspath(ref)
    raise RollstoreError(f"{ref}: no such model directory (give a local model directory or {TINY_REF})")


def resolve_prompts(
    ref: str, n: int | None = None, seed: int = 0, split: str = "train", template: str | None = None
):
    """Prompts from `builtin:arith` or a JSONL/Parquet file.

    builtin:arith: `split` is a task split (`train`, `harder`) for training prompts (n of them,
    deterministic by seed) or `heldout` / `heldout-harder` for the fixed held-out prompts.
    A file: all its prompts, or n of them chosen by a seeded shuffle (cycling if n exceeds them).
    """
    from rollout import arith
    from rollout.datasets import load_prompts

    if ref == ARITH_REF or ref.startswith(ARITH_REF + ":"):
        if ref != ARITH_REF:  # builtin:arith:harder; asked for its held-out prompts: heldout-harder
            named = ref.split(":", 2)[2]
            if split.startswith("heldout") and not named.startswith("heldout"):
                split = "heldout" if named == "train" else f"heldout-{named}"
            else:
                split = named
        n = 64 if n is None else n
        if split.startswith("heldout"):
            sub = split.split("-", 1)[1] if "-" in split else "train"
            return arith.heldout_prompts(n, split=sub)
        return arith.train_prompts(n, seed, split=split)
    prompts = load_prompts(ref, template=template)
    if n is None:
        return prompts
    order = list(range(len(prompts)))
    random.Random(f"prompts:{seed}").shuffle(order)
    return [prompts[order[i % len(order)]] for i in range(n)]
