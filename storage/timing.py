"""Phase timers: wall seconds of the named phases of a piece of work, added into a plain dict.

Lives in `storage` (the bottom package) only so that every layer can report its phases into one
dict — the loop's per-iteration profile collects generation, reward and scoring (rollstore),
append and curation, optimiser steps and checkpoint publish (learner) in the same place.

Invariants:
- A `Stopwatch` over `None` measures nothing and costs one attribute check per lap.
- Laps add to existing keys (a phase that runs twice in one iteration counts both times) and
  time is monotonic (`time.perf_counter`).
"""

from __future__ import annotations

import time


class Stopwatch:
    """`lap(name)` adds the seconds since the previous lap (or creation) to `into[name]`."""

    def __init__(self, into: dict[str, float] | None):
        self.into = into
        self.last = time.perf_counter()

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        spent, self.last = now - self.last, now
        if self.into is not None:
            self.into[name] = self.into.get(name, 0.0) + spent
        return spent
