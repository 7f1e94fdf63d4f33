"""The defaults of the everyday commands, in one place: the command line and the Python front door
(`rollstore.open(...)`) both read them.

Invariants:
- Every default of `rollstore generate`, `curate`, `train` and `sql` that the front door also takes
  is defined here once; `rollstore/cli/commands.py` declares its options with these values and
  `rollstore/handle.py` uses them as keyword defaults, so the two doors never drift apart
  (`tests/test_front_door.py` checks the CLI's declared defaults against these).
- The learner's own dataclasses (`learner.config.TrainConfig`, `generate.GenerationConfig`) keep
  the low-level defaults of their functions; `train_config` and `generation_config` build them
  with the values below.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerateDefaults:
    """`rollstore generate` / `Buffer.generate`."""

    prompts: str = "builtin:arith"
    model: str = "builtin:tiny"
    backend: str = "hf"
    group_size: int = 8
    num_prompts: int = 64
    seed: int = 0
    steps: int = 1
    run_id: str = "gen"
    max_new_tokens: int = 12
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(frozen=True)
class TrainDefaults:
    """`rollstore train` / `Buffer.train`."""

    model: str = "builtin:tiny"
    loss: str = "grpo"
    lr: float = 2e-5
    epochs: int = 1
    micro_batch_size: int = 64
    grad_accum: int = 1
    run_id: str = "train"


@dataclass(frozen=True)
class CurateDefaults:
    """`rollstore curate` / `Buffer.curate`."""

    memory_limit: str = "2GB"
    timeout: float = 600.0  # seconds the user SQL (where, a custom recipe) may run; 0: no limit
    engine: str = "embedded"


@dataclass(frozen=True)
class SqlDefaults:
    """`rollstore sql` / `Buffer.sql`."""

    timeout: float = 60.0
    memory_limit: str = "2GB"


GENERATE = GenerateDefaults()
TRAIN = TrainDefaults()
CURATE = CurateDefaults()
SQL = SqlDefaults()


def train_config(loss: str = TRAIN.loss, lr: float = TRAIN.lr, epochs: int = TRAIN.epochs,
                 micro_batch_size: int = TRAIN.micro_batch_size, grad_accum: int = TRAIN.grad_accum):
    """A `TrainConfig` with these defaults (imports torch)."""
    from rollstore.learner.config import TrainConfig

    return TrainConfig(loss=loss, lr=lr, epochs=epochs, micro_batch_size=micro_batch_size, grad_accum=grad_accum)


def generation_config(backend: str = GENERATE.backend, group_size: int = GENERATE.group_size,
                      max_new_tokens: int = GENERATE.max_new_tokens, temperature: float = GENERATE.temperature,
                      top_p: float = GENERATE.top_p, seed: int = GENERATE.seed):
    """A `GenerationConfig` with these defaults."""
    from rollstore.loop.generate import GenerationConfig

    return GenerationConfig(backend=backend, group_size=group_size, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_p=top_p, seed=seed)
