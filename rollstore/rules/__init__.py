"""The rules of the front door's numbers and words, once for both doors: the command line
(`rollstore/cli/options.py` attaches them to its options) and the Python front door
(`rollstore/handle.py` checks its keywords with them) refuse the same values with the same words.

Invariants:
- Floats must be finite (`nan`, `inf` are refused everywhere); integers must fit a signed 64-bit
  integer (what SQLite and Arrow hold): `snapshot=10**30` is refused, never an OverflowError later.
- Each `Rule` states its kind (int or float) and range (`low`/`high`, open or closed); `problem`
  says why a value is refused, or None.
- `check(table, values)` applies a command's table (`TRAIN`, `GENERATE`, `CURATE`, `SQL`) to the
  keywords of a front-door call before anything is opened or written, and raises one `OptionError`
  line (`train: epochs: 0 is not ≥ 1`); a value of the wrong type (a string for a count, a bool, a
  float for an integer) is refused too, as the command line's parser refuses it.
- A command's option and the front door's keyword of the same name share one `Rule` object
  (`tests/test_front_door.py` checks it), so the two doors cannot drift apart.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from rollstore.storage.errors import RollstoreError

INT64_MAX = 2**63 - 1
MAX_SECONDS = 1e9  # about 31 years: beyond it a timer or a sleep overflows (threading.TIMEOUT_MAX)


class OptionError(RollstoreError, ValueError):
    """A value of an option or keyword that its rule refuses (one line; nothing was opened or written)."""


@dataclass(frozen=True)
class Rule:
    """The values a numeric option accepts: finite, of its kind, within [low, high] (open ends when asked)."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # appended to the message (what 0 means, ...)
    integer: bool = False  # a count, a seed, a snapshot: an int (a float like 2.0 is refused)

    def problem(self, value: Any) -> Optional[str]:
        """Why `value` is refused, or None when it is fine."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return f"{value!r} is not {'an integer' if self.integer else 'a number'}"
        if self.integer and not isinstance(value, numbers.Integral):
            return f"{value!r} is not an integer"
        if not isinstance(value, numbers.Integral) and not math.isfinite(value):
            return f"{value} is not a finite number"
        if isinstance(value, numbers.Integral) and not -INT64_MAX - 1 <= value <= INT64_MAX:
            return f"{value} does not fit a 64-bit integer"
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return f"{value:g} is not {'>' if self.low_open else '≥'} {self.low:g}{self.note}"
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            return f"{value:g} is not {'<' if self.high_open else '≤'} {self.high:g}{self.note}"
        return None


def count(low: int = 1) -> Rule:
    """An integer ≥ `low` (default 1): epochs, sizes, iterations, ranks."""
    return Rule(low=low, integer=True)


def seconds(zero: str = "") -> Rule:
    """A duration: finite, 0 ≤ s ≤ 1e9 (`zero`: what 0 means, e.g. "no limit")."""
    return Rule(low=0, high=MAX_SECONDS, note=f" (seconds; 0: {zero})" if zero else " (seconds)")


def positive(high: Optional[float] = None) -> Rule:
    """A finite number > 0 (a learning rate, a temperature, a size), at most `high` when given."""
    return Rule(low=0, low_open=True, high=high)


SEQ = Rule(low=0, integer=True)  # a manifest sequence number (a snapshot)
SEED = Rule(low=0, high=2**32 - 1, integer=True)  # what numpy accepts
FRACTION = Rule(low=0, low_open=True, high=1)  # top-p
COUNT = count()
VERSION = count(low=0)  # a policy version
LR = positive()
TEMPERATURE = positive()
SQL_TIMEOUT = seconds("no limit")
CURATE_TIMEOUT = seconds("no limit")
POLL = Rule(low=0, low_open=True, high=MAX_SECONDS, note=" (seconds)")  # a polling interval
MAX_IDLE = seconds("never")
COMPACT_EVERY = Rule(low=0, integer=True, note=" (iterations; 0: never)")

# The front door's keywords (rollstore/handle.py) and the command line's options of the same name.
TRAIN = {"lr": LR, "epochs": COUNT, "micro_batch_size": COUNT, "grad_accum": COUNT, "poll": POLL,
         "max_idle": MAX_IDLE, "keep_checkpoints": COUNT}
GENERATE = {"group_size": COUNT, "num_prompts": COUNT, "policy_version": VERSION, "seed": SEED, "steps": COUNT,
            "max_new_tokens": COUNT, "temperature": TEMPERATURE, "top_p": FRACTION, "max_policy_lag": VERSION}
CURATE = {"snapshot": SEQ, "timeout": CURATE_TIMEOUT, "partitions": COUNT}
SQL = {"snapshot": SEQ, "timeout": SQL_TIMEOUT}
LOOP = {"compact_every": COMPACT_EVERY}  # LoopConfig's fields checked by `LoopConfig.check` (and `rollstore loop`)
BATCHES = {"batch_size": COUNT, "shuffle_seed": SEED, "pad_id": VERSION}  # Curation.batches (no command)


def check(command: str, table: Mapping[str, Rule], values: Mapping[str, Any], optional=()) -> None:
    """Refuse (one `OptionError` line) the first of `values` that its rule in `table` refuses; None
    is refused too, except for the `optional` names (None: "not given", the default applies)."""
    for name, value in values.items():
        rule = table[name]
        if value is None and name in optional:
            continue
        why = rule.problem(value)
        if why is not None:
            raise OptionError(f"{command}: {name}: {why}")


def text(command: str, name: str, value: Any, *, optional: bool = False) -> Optional[str]:
    """`value` as the string a word or a path option takes (a str, or an os.PathLike where a path is
    meant); anything else is one `OptionError` line, as a missing or mistyped argument is."""
    if value is None and optional:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise OptionError(f"{command}: {name}: {value!r} is not a string")
    if "\x00" in value:
        raise OptionError(f"{command}: {name}: a NUL character is not allowed")
    return value


def flag(command: str, name: str, value: Any) -> bool:
    """A bool keyword; anything else (1, "yes", None) is one `OptionError` line."""
    if not isinstance(value, bool):
        raise OptionError(f"{command}: {name}: {value!r} is not True or False")
    return value


def one_of(command: str, name: str, value: Any, allowed) -> str:
    """A word out of `allowed`; anything else is one `OptionError` line."""
    allowed = tuple(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise OptionError(f"{command}: {name}: {value!r} is not one of {', '.join(allowed)}")
    return value
