"""The defaults of the everyday commands, in one place, in the library: the Python front door
(`rollstore.open(...)`, `rollstore/handle.py`) takes them as keyword defaults and the command line,
which calls the front door, declares its options with the same values.

Invariants:
- Every default of `rollstore generate`, `curate`, `train` and `sql` that the front door also takes
  is defined here once, so the two doors never drift apart (`tests/test_front_door.py` checks the
  CLI's declared defaults against these).
- This module imports nothing of the application (`train_config` imports the learner layer when
  called): `cli/`, `loop/` and the front door read it.
- The learner's own dataclasses (`learner.config.TrainConfig`, `generate.GenerationConfig`) keep
  the low-level defaults of their functions; `train_config` builds a `TrainConfig` with the values
  below.
"""

from __future__ import annotations

from dataclasses import dataclass

# The recommended recipe (docs/recipes.md: d3s for long reasoning chains): what `rollstore loop`
# and `generate --follow` curate each step with unless told otherwise.
RECIPE = "d3s"


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
    max_policy_lag: int = 1  # with follow: wait while the learner is this many versions behind
    recipe: str = RECIPE  # with follow: the recipe that curates each step


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
    keep_checkpoints: int = 3  # the newest K checkpoints of the run keep their files (learner/retention.py)
    poll: float = 1.0  # seconds between polls while following
    max_idle: float = 0.0  # following: stop after this many idle seconds (0: never)
    parallel: str = "none"


@dataclass(frozen=True)
class CurateDefaults:
    """`rollstore curate` / `Buffer.curate`."""

    memory_limit: str = "2GB"
    timeout: float = 600.0  # seconds the user SQL (where, a custom recipe) may run; 0: no limit
    engine: str = "embedded"
    scheduler: str | None = None  # with the dask engine: a scheduler address or local:N (None: local)
    partitions: int | None = None  # with the dask engine: hash partitions of the batch (None: 2 per worker)


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

