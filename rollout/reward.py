"""Rewards: math-verify verdicts computed in a process pool, plus optional DAPO overlong shaping.

Invariants:
- Verdicts are computed in worker processes (spawn or forkserver), never in threads: math-verify's
  own timeouts use signals, so its timeouts are switched off and each item runs under one
  `setitimer` deadline of `timeout_s` inside the worker instead.
- Every item gets exactly one `Verdict`, in input order; nothing an answer contains can crash the
  run. A gold answer that does not parse, a verifier exception, an item that overruns its deadline,
  or a worker that hangs in C code or dies gives `correct=None` with `verify_error` saying why.
  A prediction that does not parse is simply wrong (`correct=False`, no error).
- A worker stuck past its deadline (uninterruptible C code) is killed with its pool; the other
  in-flight items are re-run on a fresh pool (a stuck chunk item by item), so one bad item never
  costs another its verdict.
- reward = (1.0 if correct else 0.0) + overlong_penalty(len, l_max, l_cache) when shaping is on;
  always finite. Shaping never changes `correct` (curation filters on `correct`, not reward).
- `verify(gold, prediction)`: gold first, as math-verify expects (its comparison is asymmetric).
- Integer answers are judged in the caller: when the judge is `judge_math` and both gold and
  prediction are plain integers (`-?digits`, at most 18 digits, surrounding whitespace allowed),
  or the prediction is blank, the verdict is integer equality (blank: wrong) — what math-verify returns for such a pair (tested against it),
  without the trip to a worker. Everything else goes to math-verify in the pool.
- Starting the pool never re-runs the caller's script in the workers (see `_main_script_hidden`),
  so a plain script without an `if __name__ == "__main__"` guard can use it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing as mp
import os
import re
import signal
import sys
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Callable

Judge = Callable[[str | None, str], tuple[bool | None, str | None]]


@dataclass(frozen=True)
class Verdict:
    correct: bool | None
    reward: float
    verify_error: str | None


@dataclass(frozen=True)
class Overlong:
    """DAPO overlong shaping: 0 up to l_max − l_cache tokens, linear down to −1 at l_max, −1 beyond."""

    l_max: int
    l_cache: int

    def __post_init__(self):
        if not 0 <= self.l_cache <= self.l_max:
            raise ValueError(f"overlong shaping needs 0 <= l_cache <= l_max, got {self.l_cache}, {self.l_max}")


def overlong_penalty(length: int, l_max: int, l_cache: int) -> float:
    """docs/curation.md §Overlong shaping: 0 when |y| <= L_max − L_cache;
    ((L_max − L_cache) − |y|)/L_cache up to L_max; −1 beyond."""
    soft = l_max - l_cache
    if length <= soft:
        return 0.0
    if length <= l_max:
        return (soft - length) / l_cache
    return -1.0


# ---------------------------------------------------------------- worker side (runs in the pool)


class _ItemTimeout(BaseException):
    """Raised by the item timer. A BaseException, so math-verify's `except Exception` lets it through."""


def _has_expression(parsed) -> bool:
    return any(not isinstance(x, str) for x in parsed)


_PLAIN_NUMBER = re.compile(r"^\s*-?\d+(\.\d+)?\s*$")
_PLAIN_INTEGER = re.compile(r"^\s*-?\d{1,18}\s*$")


def integer_verdict(gold: str | None, prediction: str) -> tuple[bool | None, str | None] | None:
    """(correct, None) when gold is a plain integer and the prediction a plain integer or blank (an
    empty answer parses to nothing: wrong), else None (ask math-verify)."""
    if gold is None or not _PLAIN_INTEGER.match(gold):
        return None
    if not prediction.strip():
        return False, None
    if not _PLAIN_INTEGER.match(prediction):
        return None
    return int(gold) == int(prediction), None


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str):
    """Gold parsed as LaTeX math (`$gold$`), else as given; a group's G items share one parse."""
    from math_verify import parse

    if _PLAIN_NUMBER.match(gold):  # fast path: a bare number needs no LaTeX parser
        return parse(gold.strip(), parsing_timeout=None)
    parsed = parse(f"${gold}$", parsing_timeout=None)
    if not _has_expression(parsed):
        parsed = parse(gold, parsing_timeout=None)
    return parsed


def judge_math(gold: str | None, prediction: str) -> tuple[bool | None, str | None]:
    """(correct, verify_error) by math-verify. Call it where signals work (a worker's main thread)."""
    from math_verify import parse, verify

    if gold is None or not str(gold).strip():
        return None, "no gold answer"
    gold = str(gold)
    parsed_gold = _parse_gold(gold)
    if not _has_expression(parsed_gold):
        return None, f"unparsable gold answer {gold[:80]!r}"
    parsed_pred = parse(prediction, parsing_timeout=None)
    if not parsed_pred:
        parsed_pred = parse(f"${prediction}$", parsing_timeout=None)
    if not parsed_pred:
        return False, None
    return bool(verify(parsed_gold, parsed_pred, timeout_seconds=None)), None


def _on_alarm(signum, frame):
    raise _ItemTimeout()


def _init_worker() -> None:
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    signal.signal(signal.SIGALRM, _on_alarm)


def _judge_item(judge: Judge, gold: str | None, prediction: str, timeout_s: float):
    """One verdict under a deadline; never raises (a timer firing anywhere in here is a timeout)."""
    try:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            correct, error = judge(gold, prediction)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return (None if correct is None else bool(correct)), error
    except _ItemTimeout:
        return None, f"timeout: verification took over {timeout_s:g}s"
    except Exception as exc:  # a verifier bug on a strange answer must not stop the run
        return None, f"verifier error: {type(exc).__name__}: {str(exc)[:160]}"


def _judge_items(judge: Judge, golds: list, predictions: list, timeout_s: float) -> list:
    return [_judge_item(judge, g, p, timeout_s) for g, p in zip(golds, predictions)]


def _warm(judge: Judge) -> int:
    """First task of a worker: imports and first-call caches, so item deadlines measure work."""
    try:
        judge("1", "1")
    except Exception:
        pass
    time.sleep(0.05)  # let the other workers pick up their own warm-up task
    return os.getpid()


# ---------------------------------------------------------------- parent side


@contextlib.contextmanager
def _main_script_hidden(judge: Judge):
    """While workers start, hide the path of a `python script.py` main module from multiprocessing.

    A spawned worker otherwise re-runs the user's script top to bottom before serving (and an
    unguarded script would start generating again, recursively). Workers only run functions
    importable by module name, so they never need it. Skipped when the judge itself lives in
    `__main__` (then the worker must import the script, as multiprocessing normally does).
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or getattr(main, "__spec__", None) is not None \
            or getattr(judge, "__module__", None) == "__main__":
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


class RewardPool:
    """A reusable pool of verifier processes. Use as a context manager or call close()."""

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 5.0,
        grace_s: float = 5.0,
        start_method: str = "spawn",
        judge: Judge = judge_math,
        startup_timeout_s: float = 120.0,
        chunk_size: int = 16,
    ):
        if start_method not in ("spawn", "forkserver"):
            raise ValueError("start_method must be 'spawn' or 'forkserver' (fork is unsafe with torch)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.workers = max(1, int(workers))
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s)
        self.start_method = start_method
        self.judge = judge
        self.startup_timeout_s = startup_timeout_s
        self.chunk_size = max(1, int(chunk_size))
        self._executor: ProcessPoolExecutor | None = None
        self.restarts = 0  # pools killed because of a hung or dead worker

    # -- lifecycle
    def _pool(self) -> ProcessPoolExecutor:
        """The running pool, started (all workers spawned and warmed up) on first use."""
        if self._executor is None:
            ex = ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=mp.get_context(self.start_method),
                initializer=_init_worker,
            )
            try:
                # Workers are spawned by these first submits (one per submit while none is idle).
                with _main_script_hidden(self.judge):
                    deadline = time.monotonic() + self.startup_timeout_s
                    pids: set[int] = set()
                    while len(pids) < self.workers and time.monotonic() < deadline:
                        futs = [ex.submit(_warm, self.judge) for _ in range(self.workers)]
                        for f in futs:
                            pids.add(f.result(timeout=max(1.0, deadline - time.monotonic())))
            except BaseException:
                ex.shutdown(wait=False, cancel_futures=True)
                raise
            self._executor = ex
        return self._executor

    def _kill(self) -> None:
        ex, self._executor = self._executor, None
        if ex is None:
            return
        for proc in list(getattr(ex, "_processes", {}).values()):
            try:
                proc.kill()
            except Exception:
                pass
        ex.shutdown(wait=True, cancel_futures=True)
        self.restarts += 1

    def close(self) -> None:
        ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort; close() is the contract
        try:
            self.close()
        except Exception:
            pass

    # -- verdicts
    def verify(self, gold: str | None, prediction: str) -> tuple[bool | None, str | None]:
        """(correct, verify_error) of one answer; gold first."""
        return self.verify_batch([gold], [prediction])[0]

    def verify_batch(
        self, golds: list[str | None], predictions: list[str]
    ) -> list[tuple[bool | None, str | None]]:
        """(correct, verify_error) per item, in order.

        Items travel in chunks of `chunk_size`, at most one chunk per worker, so a chunk's deadline
        (items × timeout_s + grace_s) runs from when a worker takes it. A chunk that hangs or kills
        its worker is split into single items and re-run on a fresh pool, which pins the blame on
        the item at fault; the others still get their verdicts.
        """
        if len(golds) != len(predictions):
            raise ValueError("golds and predictions differ in length")
        results: list[tuple[bool | None, str | None] | None] = [None] * len(golds)
        if self.judge is judge_math:  # plain integers need no parser (module invariants)
            for i, (g, p) in enumerate(zip(golds, predictions)):
                results[i] = integer_verdict(None if g is None else str(g), p)
        idx = [i for i, r in enumerate(results) if r is None]
        pending = deque(idx[k : k + self.chunk_size] for k in range(0, len(idx), self.chunk_size))
        deaths: dict[int, int] = {}
        inflight: dict[Future, tuple[list[int], float]] = {}

        def limit(unit: list[int]) -> float:
            return len(unit) * self.timeout_s + self.grace_s

        def requeue(unit: list[int]) -> None:
            if len(unit) > 1:  # split: find the culprit item by item
                pending.extend([i] for i in unit)
            else:
                pending.appendleft(unit)

        while pending or inflight:
            pool = self._pool()
            try:
                while pending and len(inflight) < self.workers:
                    unit = pending.popleft()
                    fut = pool.submit(
                        _judge_items, self.judge, [golds[i] for i in unit],
                        [predictions[i] for i in unit], self.timeout_s,
                    )
                    inflight[fut] = (unit, time.monotonic())
                next_deadline = min(t + limit(u) for u, t in inflight.values())
                done, _ = wait(list(inflight), timeout=max(0.0, next_deadline - time.monotonic()),
                               return_when=FIRST_COMPLETED)
                for fut in done:
                    unit, _ = inflight.pop(fut)
                    for i, verdict in zip(unit, fut.result()):
                        results[i] = verdict
            except BrokenProcessPool:  # a worker died: any unit in flight may be the cause
                self._kill()
                for unit, _ in inflight.values():
                    if len(unit) == 1:
                        deaths[unit[0]] = deaths.get(unit[0], 0) + 1
                        if deaths[unit[0]] >= 2:
                            results[unit[0]] = (None, "verifier process died on this item")
                            continue
                    requeue(unit)
                inflight.clear()
                continue
            now = time.monotonic()
            hung = [f for f, (u, t) in inflight.items() if now - t >= limit(u) and not f.done()]
            if hung:  # stuck in uninterruptible code: kill the pool, re-run the others
                for fut in hung:
                    unit, _ = inflight.pop(fut)
                    if len(unit) == 1:
                        results[unit[0]] = (
                            None, f"timeout: verifier hung for over {limit(unit):g}s and was killed",
                        )
                    else:
                        requeue(unit)
                for unit, _ in inflight.values():
                    pending.appendleft(unit)
                inflight.clear()
                self._kill()
        return [r if r is not None else (None, "not verified") for r in results]

    def rewards(
        self,
        golds: list[str | None],
        predictions: list[str],
        lengths: list[int] | None = None,
        overlong: Overlong | None = None,
    ) -> list[Verdict]:
        """Verdict per item: reward = correctness (1/0) + overlong shaping (needs `lengths`)."""
        if overlong is not None and lengths is None:
            raise ValueError("overlong shaping needs response lengths")
        verdicts = []
        for k, (correct, error) in enumerate(self.verify_batch(golds, predictions)):
            reward = 1.0 if correct else 0.0
            if overlong is not None:
                reward += overlong_penalty(lengths[k], overlong.l_max, overlong.l_cache)
            verdicts.append(Verdict(correct, float(reward), error))
        return verdicts


def compute_rewards(
    golds: list[str | None],
    predictions: list[str],
    lengths: list[int] | None = None,
    overlong: Overlong | None = None,
    pool: RewardPool | None = None,
    **pool_kwargs,
) -> list[Verdict]:
    """One-shot helper: verdicts with a given pool, or with a temporary one."""
    if pool is not None:
        return pool.rewards(golds, predictions, lengths, overlong)
    with RewardPool(**pool_kwargs) as tmp:
        return tmp.rewards(golds, predictions, lengths, overlong)
