"""Rewards through the process pool: math-verify verdicts, failures as verify_error, overlong shaping."""

from __future__ import annotations

import itertools
import time

import pytest

from rollstore.rollout.reward import Overlong, RewardPool, Verdict, compute_rewards, judge_math, overlong_penalty


# Judges for the failure tests. Module-level, so the spawned workers can import them by name.
def slow_python_judge(gold, prediction):
    if prediction == "slow":  # interruptible: the worker's item timer stops it
        end = time.monotonic() + 60
        while time.monotonic() < end:
            pass
    if prediction == "boom":
        raise RuntimeError("verifier bug")
    return judge_math(gold, prediction)


def stuck_c_judge(gold, prediction):
    if prediction == "stuck":  # uninterruptible C loop: only killing the worker stops it
        sum(itertools.repeat(1, 10**13))
    return judge_math(gold, prediction)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(workers=2, timeout_s=5.0) as p:
        yield p


def test_math_verify_verdicts_through_the_pool(pool):
    cases = [
        (r"\frac{1}{2}", "0.5", True),
        ("0.5", r"\frac{1}{2}", True),
        (r"\boxed{19}", "19", True),
        ("19", r"The answer is \boxed{19}.", True),
        ("19", "20", False),
        ("-5", "-5", True),
        ("42", "I do not know", False),
        ("42", "", False),
        (r"\frac{1}{", "1", None),  # unparsable gold
        (None, "1", None),  # no gold
    ]
    got = pool.verify_batch([g for g, _, _ in cases], [p for _, p, _ in cases])
    assert [c for c, _ in got] == [want for _, _, want in cases]
    errors = [e for _, e in got]
    assert errors[:8] == [None] * 8
    assert "unparsable gold" in errors[8] and errors[9] == "no gold answer"
    assert pool.verify(r"\boxed{19}", "19") == (True, None)  # gold first


def test_rewards_with_overlong_shaping(pool):
    verdicts = pool.rewards(["7", "7", "7", "bad{"], ["7", "8", "7", "7"], [3, 3, 9, 3], Overlong(8, 4))
    assert verdicts[0] == Verdict(True, 1.0, None)
    assert verdicts[1] == Verdict(False, 0.0, None)
    assert verdicts[2].correct is True and verdicts[2].reward == pytest.approx(1.0 - 1.0)
    assert verdicts[3].correct is None and verdicts[3].reward == 0.0 and verdicts[3].verify_error
    plain = compute_rewards(["3"], ["3"], pool=pool)
    assert plain == [Verdict(True, 1.0, None)]


def test_overlong_penalty_formula():
    # docs/curation.md §Overlong shaping with L_max 20, L_cache 4: 0 up to 16, linear to -1 at 20, -1 beyond.
    assert overlong_penalty(10, 20, 4) == 0.0
    assert overlong_penalty(16, 20, 4) == 0.0
    assert overlong_penalty(17, 20, 4) == pytest.approx(-0.25)
    assert overlong_penalty(20, 20, 4) == pytest.approx(-1.0)
    assert overlong_penalty(21, 20, 4) == -1.0
    assert overlong_penalty(20480, 20480, 4096) == pytest.approx(-1.0)
    with pytest.raises(ValueError):
        Overlong(4, 8)


def test_slow_item_times_out_and_bad_answers_never_crash():
    with RewardPool(workers=2, timeout_s=0.5, judge=slow_python_judge) as p:
        got = p.verify_batch(["1", "2", "3", "4"], ["1", "slow", "boom", "4"])
    assert got[0] == (True, None) and got[3] == (True, None)
    assert got[1][0] is None and got[1][1].startswith("timeout")
    assert got[2][0] is None and "verifier error: RuntimeError" in got[2][1]


def test_hung_worker_is_killed_and_others_still_judged():
    with RewardPool(workers=1, timeout_s=0.3, grace_s=0.7, judge=stuck_c_judge, chunk_size=4) as p:
        t0 = time.monotonic()
        got = p.verify_batch(["1", "2", "3", "4", "5"], ["1", "stuck", "3", "x", "5"])
        elapsed = time.monotonic() - t0
        assert p.restarts >= 1
        assert p.verify("6", "6") == (True, None)  # the pool is usable again
    assert got[0] == (True, None) and got[2] == (True, None) and got[4] == (True, None)
    assert got[3] == (False, None)
    assert got[1][0] is None and "hung" in got[1][1]
    assert elapsed < 60


def test_unguarded_script_is_not_rerun_by_the_workers(tmp_path):
    """Spawned workers must not re-execute a user's script that lacks `if __name__ == "__main__"`."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {root!r})\n"
        "from rollstore.rollout.reward import RewardPool\n"
        "print('top-level run', flush=True)\n"
        "with RewardPool(workers=1) as pool:\n"
        "    print(pool.verify('2', '2'), flush=True)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("top-level run") == 1 and "(True, None)" in out.stdout


def test_integer_fast_path_agrees_with_math_verify():
    """The in-caller integer verdict is what math-verify says for the same plain-integer pair."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from rollstore.rollout.reward import integer_verdict

    ints = st.integers(min_value=-10**6, max_value=10**6)
    text = st.one_of(ints.map(str), ints.map(lambda x: f" {x} "), ints.map(lambda x: f"0{abs(x)}"))

    @settings(max_examples=150, deadline=None)
    @given(ints, text, st.booleans())
    def check(gold, pred, same):
        pred = f" {gold}" if same else pred
        fast = integer_verdict(str(gold), pred)
        assert fast is not None and fast == judge_math(str(gold), pred)

    check()
    assert integer_verdict("12", "12+1") is None and integer_verdict(r"\frac{1}{2}", "1") is None
    assert integer_verdict("7", "1" * 19) is None  # beyond 18 digits: math-verify decides
    for blank in ("", "  "):
        assert integer_verdict("7", blank) == judge_math("7", blank) == (False, None)
