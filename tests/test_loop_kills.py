"""A handful of bench/loop_kills.py's trials: the loop SIGKILLed after a step's curation commit
(the issue 47 failure) and at other commit boundaries, resumed, then `train --run-id` of its run;
nothing is trained twice into the run and nothing is left pending. The checker is shown to catch
the old behaviour (a resumed step curated again), so the test can fail.

Each trial runs in a fresh Python process (as `python -m bench.loop_kills` does): a trial forks its
children, and a child forked from a pytest worker whose earlier tests had started torch's OpenMP
threads can crash in its first parallel region (a segfault under `make test`'s workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fresh(call: str) -> dict:
    """`loop_kills.<call>` in a new interpreter (one torch thread); its result dict."""
    code = f"import json; from bench import loop_kills as k; k.warm(); print(json.dumps(k.{call}, default=str))"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("recipe,point,nth", [("grpo", "curation", 1), ("greso", "curation", 2),
                                               ("replay-d3s", "curation", 2), ("d3s", "train", 1),
                                               ("grpo", "publish", 1)])
def test_killed_loop_resumes_exactly_once(recipe, point, nth):
    r = fresh(f"trial({recipe!r}, {point!r}, {nth}, iterations=2)")
    assert r["killed"], r
    assert r["violations"] == [], r


def test_checker_catches_a_step_curated_again():
    r = fresh("trial('grpo', 'curation', 1, iterations=2, fixed=False)")
    assert r["killed"]
    assert any(v.startswith("late-train") for v in r["violations"]), r
    assert any(v.startswith("step-twice") for v in r["violations"]), r


def test_leasing_learner_killed_after_its_ack_resumes_exactly_once():
    """The two-process mode: `train --follow` SIGKILLed after its publish transaction acked the
    leases (before it commits); a new learner of the run takes over beside the generator."""
    r = fresh("lease_trial('grpo', 'ack', 2, steps=2)")
    assert r["killed"], r
    assert r["violations"] == [], r
