"""builtin:arith: determinism, graded levels, a fixed held-out partition, warm-start examples."""

from __future__ import annotations

import pytest

from rollout import arith
from rollout.prompts import prompt_hash


def test_prompts_are_deterministic_by_seed():
    a = arith.train_prompts(50, seed=3)
    assert a == arith.train_prompts(50, seed=3)
    assert [p.prompt for p in a] != [p.prompt for p in arith.train_prompts(50, seed=4)]


def test_prompt_format_and_gold_answers():
    for p in arith.train_prompts(200, seed=0):
        assert p.prompt.endswith("=") and " " not in p.prompt
        assert p.gold_answer == str(arith.evaluate(p.prompt[:-1]))
        assert int(p.gold_answer) == eval(p.prompt[:-1])  # noqa: S307 - our own digits and + - *
        assert p.prompt_id == prompt_hash(p.prompt)
        assert p.source == "builtin:arith"
        assert p.difficulty in arith.LEVELS


def test_levels_are_graded_and_interleaved():
    prompts = arith.train_prompts(50, seed=1)
    assert [p.difficulty for p in prompts[:10]] == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5]
    for p in prompts:
        spec = arith.LEVELS[p.difficulty]
        body = p.prompt[:-1]
        numbers = [int(x) for x in body.replace("-", "+").replace("*", "+").split("+")]
        assert len(numbers) in spec.operands
        assert all(spec.digits[0] <= len(str(x)) <= spec.digits[1] for x in numbers)
        assert all(ch.isdigit() or ch in spec.ops for ch in body)
        if spec.need_mul:
            assert "*" in body


def test_evaluate_precedence():
    assert arith.evaluate("3+4*5") == 23
    assert arith.evaluate("7-2*3") == 1
    assert arith.evaluate("2*3*4-5") == 19
    assert arith.evaluate("12-17") == -5
    with pytest.raises(ValueError):
        arith.evaluate("1++2")


def test_heldout_is_fixed_disjoint_and_prefix_stable():
    held = arith.heldout_prompts(300)
    assert held == arith.heldout_prompts(300)
    assert arith.heldout_prompts(100) == held[:100]
    assert all(arith.is_heldout(p.prompt) for p in held)
    train = {p.prompt for s in range(5) for p in arith.train_prompts(300, seed=s)}
    warm = {q for q, _ in arith.warmup_examples(3000, seed=0)}
    held_texts = {p.prompt for p in held}
    assert not (held_texts & train) and not (held_texts & warm)
    assert len(held_texts) == len(held)  # distinct: no expression weighs more than another


def test_small_levels_leave_the_heldout_rotation_when_exhausted():
    held = arith.heldout_prompts(600)
    for lv in (1, 3):  # whole domains of 200 and 100 expressions: every held-out one, once
        domain = [e for e in arith._domain(arith.LEVELS[lv]) if arith.is_heldout(e)]
        assert sorted(p.prompt for p in held if p.difficulty == lv) == sorted(domain)
    big = [sum(p.difficulty == lv for p in held) for lv in (2, 4, 5)]
    assert max(big) - min(big) <= 1 and sum(big) == 600 - sum(p.difficulty in (1, 3) for p in held)
    only3 = arith.heldout_prompts(50, levels=(3,))
    assert 0 < len(only3) < 50  # a split smaller than n gives all it has


def test_harder_split_and_explicit_levels():
    hard = arith.train_prompts(40, seed=0, split="harder")
    assert {p.difficulty for p in hard} == set(arith.SPLITS["harder"])
    only3 = arith.heldout_prompts(10, levels=(3,))
    assert {p.difficulty for p in only3} == {3}
    with pytest.raises(ValueError):
        arith.train_prompts(5, split="nope")
    with pytest.raises(ValueError):
        arith.train_prompts(5, levels=(9,))


def test_warmup_examples_are_prompt_answer_text():
    ex = arith.warmup_examples(100, seed=2)
    assert ex == arith.warmup_examples(100, seed=2)
    assert all(q.endswith("=") and a == str(arith.evaluate(q[:-1])) for q, a in ex)
    assert len(arith.warmup_examples(5000, seed=0)) == 5000  # repeats allowed, and fast
