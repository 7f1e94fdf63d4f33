"""builtin:arith: determinism, graded levels, a fixed held-out partition, warm-start examples."""

from __future__ import annotations

import pytest

from rollstore.rollout import arith
from rollstore.rollout.prompt_sources import prompt_hash


def test_prompts_are_deterministic_by_seed():
    a = arith.train_prompts(50, seed=3)
    assert a == arith.train_prompts(50, seed=3)
    assert [p.prompt for p in a] != [p.prompt for p in arith.train_prompts(50, seed=4)]


def test_prompt_format_and_gold_answers():
    for p in arith.train_prompts(200, seed=0):
        assert p.prompt.endswith("=") and " " not in p.prompt
        assert p.gold_answer == str(arith.evaluate(p.prompt[:-1]))
        assert int(p.gold_answer) == eval(p.prompt[:-1])  # noqa: S307 - our own digits and +
        assert p.prompt_id == prompt_hash(p.prompt)
        assert p.source == "builtin:arith"
        assert p.difficulty in arith.LEVELS


def test_levels_are_carries_and_interleaved():
    prompts = arith.train_prompts(60, seed=1)
    assert [p.difficulty for p in prompts[:6]] == [1, 2, 3, 1, 2, 3]
    for p in prompts:
        a, b = (int(x) for x in p.prompt[:-1].split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99
        into, out = a % 10 + b % 10 >= 10, a // 10 + b // 10 + (a % 10 + b % 10 >= 10) >= 10
        assert p.difficulty == {(True, False): 1, (False, True): 2, (True, True): 3}[(into, out)]
    sizes = [sum(arith.level_of(a, b) == lv for a in arith.OPERANDS for b in arith.OPERANDS) for lv in (1, 2, 3)]
    assert sizes == [1260, 2475, 2385]  # every level has over a thousand expressions


def test_teacher_forgets_carries_at_its_slip_rate():
    ex = arith.warmup_examples(4000, seed=0)
    wrong = [(q, a) for q, a in ex if a != str(arith.evaluate(q[:-1]))]
    assert abs(len(wrong) / len(ex) - arith.TEACHER_SLIP) < 0.03
    for q, a in wrong:
        x, y = (int(v) for v in q[:-1].split("+"))
        assert int(a) == arith.carry_free_sum(x, y) == (x // 10 + y // 10) % 10 * 10 + (x + y) % 10
    assert arith.carry_free_sum(58, 67) == 15 and arith.carry_free_sum(52, 61) == 13
    assert all(a == str(arith.evaluate(q[:-1])) for q, a in arith.warmup_examples(200, seed=0, slip=0.0))


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


def test_heldout_levels_leave_the_rotation_when_exhausted():
    held = arith.heldout_prompts(5000)
    assert len(held) == len({p.prompt for p in held}) > 1000  # the whole partition, each once
    for lv in (1, 2, 3):
        domain = [f"{a}+{b}=" for a in arith.OPERANDS for b in arith.OPERANDS if arith.level_of(a, b) == lv]
        assert sorted(p.prompt for p in held if p.difficulty == lv) == sorted(e for e in domain if arith.is_heldout(e))
    first = [sum(p.difficulty == lv for p in held[:600]) for lv in (1, 2, 3)]
    assert first == [200, 200, 200]  # round-robin while every level has some left
    assert len(arith.heldout_prompts(500)) == 500


def test_harder_split_and_explicit_levels():
    hard = arith.train_prompts(40, seed=0, split="harder")
    assert {p.difficulty for p in hard} == set(arith.SPLITS["harder"])
    only3 = arith.heldout_prompts(10, levels=(3,))
    assert {p.difficulty for p in only3} == {3}
    assert all(arith.level_of(*map(int, p.prompt[:-1].split("+"))) == 3 for p in only3)
    with pytest.raises(ValueError):
        arith.train_prompts(5, split="nope")
    with pytest.raises(ValueError):
        arith.train_prompts(5, levels=(9,))


def test_warmup_examples_are_prompt_answer_text():
    ex = arith.warmup_examples(100, seed=2)
    assert ex == arith.warmup_examples(100, seed=2)
    assert all(q.endswith("=") and a.isdigit() for q, a in ex)
    assert len(arith.warmup_examples(5000, seed=0)) == 5000  # repeats allowed, and fast
