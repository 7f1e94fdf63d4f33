"""builtin:chains: written column addition, decisions at the carries, a sum-dependent weak teacher,
math-verify reads the result, a fixed held-out partition, and the other built-ins' keys unmoved."""

from __future__ import annotations

import os
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from rollstore.builtin.resolve import (TINY_MODELS, resolve_prompts, task_max_new_tokens, task_model, tiny_dir,
                                       tiny_spec, warm_targets)
from rollstore.learner.tiny import CHARS, build_tokenizer
from rollstore.rollout import chains
from rollstore.rollout.prompt_sources import prompt_hash
from rollstore.rollout.reward import judge_math

operand = st.integers(100, 999)
COLUMN = re.compile(r"^(\d)\+(\d)\+([01])=(\d{1,2})$")


def written(a: int, b: int, forget=(False, False)) -> str:
    """The working of `a+b=` written independently of the module, from the task's description."""
    da, db = str(a)[::-1], str(b)[::-1]
    cols, digits, carry = [], [], 0
    for i in range(3):
        s = int(da[i]) + int(db[i]) + carry
        cols.append(f"{da[i]}+{db[i]}+{carry}={s}")
        digits.append(str(s % 10))
        carry = s // 10 if i == 2 or not forget[i] else 0
    result = ("1" if carry else "") + "".join(reversed(digits))
    return " ".join(cols) + " = " + str(int(result))


@settings(max_examples=300, deadline=None)
@given(operand, operand, st.tuples(st.booleans(), st.booleans()))
def test_the_working_is_column_addition_and_a_slip_flows_on(a, b, forget):
    right = chains.working(a, b)
    assert right == written(a, b) and chains.final_answer(right) == str(a + b)
    assert chains.working(a, b, forget) == written(a, b, forget)
    cols, _, result = right.partition(" = ")
    assert all(COLUMN.match(c) for c in cols.split(" "))
    assert set(right) <= set(CHARS)  # the tiny tokenizer spells it, one token a character
    assert 28 <= len(right) + 1 <= chains.MAX_NEW_TOKENS  # with the end-of-sequence token
    hard = [s <= 12 for s in chains.decisions(a, b)]
    assert chains.level_of(a, b) == (0 if not hard else 1 + sum(hard))


@settings(max_examples=60, deadline=None)
@given(operand, operand, st.tuples(st.booleans(), st.booleans()))
def test_math_verify_reads_the_stated_result(a, b, forget):
    """The loop's judge (math-verify) agrees with `final_answer`: right exactly when the result is a + b."""
    text = chains.working(a, b, forget)
    correct, error = judge_math(str(a + b), text)
    assert error is None and correct == (chains.final_answer(text) == str(a + b))


def test_most_tokens_are_determined_and_few_are_decisions():
    """A response of ~30 tokens holds at most two decisions: the carry digits of the tens and hundreds."""
    tok = build_tokenizer()
    text = chains.working(158, 267)
    assert text == "8+7+0=15 5+6+1=12 1+2+1=4 = 425"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) + 1 >= 24 and chains.decisions(158, 267) == [15, 12]


def test_prompts_are_deterministic_graded_and_interleaved():
    ps = chains.train_prompts(80, seed=2)
    assert ps == chains.train_prompts(80, seed=2)
    assert [p.prompt for p in ps] != [p.prompt for p in chains.train_prompts(80, seed=3)]
    assert [p.difficulty for p in ps[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert len({p.prompt for p in ps}) == len(ps)
    for p in ps:
        a, b = (int(x) for x in p.prompt[:-1].split("+"))
        assert p.gold_answer == str(a + b) and p.difficulty == chains.level_of(a, b)
        assert p.prompt_id == prompt_hash(p.prompt) and p.source == "builtin:chains"
        assert not chains.is_heldout(p.prompt)


def test_heldout_is_fixed_distinct_disjoint_and_prefix_stable():
    held = chains.heldout_prompts(400)
    assert held[:150] == chains.heldout_prompts(150)
    assert len({p.prompt for p in held}) == 400 and all(chains.is_heldout(p.prompt) for p in held)
    train = {p.prompt for s in range(3) for p in chains.train_prompts(200, seed=s)}
    warm = {q for q, _ in chains.warmup_examples(2000, seed=0)}
    assert not train & {p.prompt for p in held} and not warm & {p.prompt for p in held}


def test_the_teacher_slips_at_the_carry_by_the_sum_that_made_it():
    """Per level, the teacher is right at its exact rate (4 standard errors); a wrong demonstration
    is the working with some carry decision forgotten, never another mistake."""
    ex = chains.warmup_examples(8000, seed=0)
    by_level: dict[int, list[bool]] = {}
    for q, ans in ex:
        a, b = (int(x) for x in q[:-1].split("+"))
        right = ans == chains.working(a, b)
        by_level.setdefault(chains.level_of(a, b), []).append(right)
        if not right:
            assert ans in {written(a, b, (x, y)) for x in (False, True) for y in (False, True)}
    expected = {0: 1.0, 3: 0.01}
    for level, hits in by_level.items():
        rate = sum(hits) / len(hits)
        assert abs(rate - chains.teacher_accuracy(level)) < 0.045, level
        if level in expected:
            assert abs(chains.teacher_accuracy(level) - expected[level]) < 1e-9
    assert 0.3 < chains.teacher_accuracy(1) < 0.9 and 0.05 < chains.teacher_accuracy(2) < 0.11


def test_references_resolve_to_the_task_its_policy_and_its_budget():
    assert resolve_prompts("builtin:chains", 12, seed=4) == chains.train_prompts(12, seed=4)
    assert resolve_prompts("builtin:chains", 5, split="heldout") == chains.heldout_prompts(5)
    assert task_model("builtin:chains") == "builtin:tiny-chains" and TINY_MODELS["builtin:tiny-chains"] == "chains"
    assert task_max_new_tokens("builtin:chains") == chains.MAX_NEW_TOKENS == 40
    assert task_max_new_tokens("builtin:arith") == 8 and task_max_new_tokens("prompts.jsonl") == 8
    assert set(warm_targets("chains")) == {0, 1}  # levels the teacher mostly gets right


def test_the_other_built_in_policies_keep_their_keys():
    """Adding a task moved no existing build: the keys of builtin:tiny and builtin:tiny-carries are as shipped before."""
    assert os.path.basename(tiny_dir(tiny_spec(task="arith"))) == "tiny-70fac9af218973f0"
    assert os.path.basename(tiny_dir(tiny_spec(task="carries"))) == "tiny-524204d84e1a6879"
    assert tiny_spec(task="chains")["task"]["name"] == "chains"
