"""A handful of bench/loop_kills.py's trials: the loop SIGKILLed after a step's curation commit
(the issue 47 failure) and at other commit boundaries, resumed, then `train --run-id` of its run;
nothing is trained twice into the run and nothing is left pending. The checker is shown to catch
the old behaviour (a resumed step curated again), so the test can fail."""

from __future__ import annotations

import pytest

from bench import loop_kills


@pytest.fixture(scope="module")
def warmed():
    loop_kills.warm()


@pytest.mark.parametrize("recipe,point,nth", [("grpo", "curation", 1), ("greso", "curation", 2),
                                               ("replay-d3s", "curation", 2), ("d3s", "train", 1),
                                               ("grpo", "publish", 1)])
def test_killed_loop_resumes_exactly_once(warmed, recipe, point, nth):
    r = loop_kills.trial(recipe, point, nth, iterations=2)
    assert r["killed"], r
    assert r["violations"] == [], r


def test_checker_catches_a_step_curated_again(warmed):
    r = loop_kills.trial("grpo", "curation", 1, iterations=2, fixed=False)
    assert r["killed"]
    assert any(v.startswith("late-train") for v in r["violations"]), r
    assert any(v.startswith("step-twice") for v in r["violations"]), r


def test_leasing_learner_killed_after_its_ack_resumes_exactly_once(warmed):
    """The two-process mode: `train --follow` SIGKILLed after its publish transaction acked the
    leases (before it commits); a new learner of the run takes over beside the generator."""
    r = loop_kills.lease_trial("grpo", "ack", 2, steps=2)
    assert r["killed"], r
    assert r["violations"] == [], r
