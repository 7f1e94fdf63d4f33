"""builtin:carries: levels are carries, a per-carry weak teacher, a fixed held-out partition, its own policy ref."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstore.builtin.resolve import TINY_MODELS, resolve_prompts, task_model, tiny_dir, tiny_spec, warm_targets
from rollstore.rollout import carries
from rollstore.rollout.prompt_sources import prompt_hash

operand = st.integers(100, 999)


def long_addition(a: int, b: int, forget=(False, False, False)) -> tuple[int, list[bool]]:
    """Schoolbook addition on digit strings, written independently of the module: (sum, carried)."""
    da, db = str(a)[::-1], str(b)[::-1]
    digits, carried, carry = [], [], 0
    for i in range(3):
        s = int(da[i]) + int(db[i]) + carry
        digits.append(str(s % 10))
        carried.append(s >= 10)
        carry = 0 if forget[i] else s // 10
    if carry:
        digits.append("1")
    return int("".join(reversed(digits))), carried


@settings(max_examples=300, deadline=None)
@given(operand, operand, st.tuples(st.booleans(), st.booleans(), st.booleans()))
def test_levels_and_slips_match_schoolbook_addition(a, b, forget):
    total, carried = long_addition(a, b)
    assert total == a + b
    assert carries.carries(a, b) == carried
    assert carries.level_of(a, b) == sum(carried)
    assert carries.slipped_sum(a, b, list(forget)) == long_addition(a, b, forget)[0]
    assert carries.slipped_sum(a, b, [False] * 3) == a + b


def test_prompts_are_deterministic_graded_and_interleaved():
    ps = carries.train_prompts(80, seed=2)
    assert ps == carries.train_prompts(80, seed=2)
    assert [p.prompt for p in ps] != [p.prompt for p in carries.train_prompts(80, seed=3)]
    assert [p.difficulty for p in ps[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert len({p.prompt for p in ps}) == len(ps)
    for p in ps:
        a, b = (int(x) for x in p.prompt[:-1].split("+"))
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert p.gold_answer == str(a + b) and p.difficulty == carries.level_of(a, b)
        assert p.prompt_id == prompt_hash(p.prompt) and p.source == "builtin:carries"
        assert not carries.is_heldout(p.prompt)


def test_heldout_is_fixed_distinct_disjoint_and_prefix_stable():
    held = carries.heldout_prompts(400)
    assert held[:150] == carries.heldout_prompts(150)
    assert len({p.prompt for p in held}) == 400
    assert all(carries.is_heldout(p.prompt) for p in held)
    assert {p.difficulty for p in held} == set(carries.LEVELS)
    train = {p.prompt for s in range(3) for p in carries.train_prompts(200, seed=s)}
    warm = {q for q, _ in carries.warmup_examples(2000, seed=0)}
    assert not train & {p.prompt for p in held} and not warm & {p.prompt for p in held}


def test_teacher_forgets_each_carry_at_its_slip_rate():
    ex = carries.warmup_examples(8000, seed=0)
    by_level: dict[int, list[bool]] = {}
    for q, ans in ex:
        a, b = (int(x) for x in q[:-1].split("+"))
        by_level.setdefault(carries.level_of(a, b), []).append(ans == str(a + b))
        if ans != str(a + b):  # a slip is some subset of the carries forgotten
            assert int(ans) in {long_addition(a, b, (x, y, z))[0] for x in (0, 1) for y in (0, 1) for z in (0, 1)}
    for level, hits in by_level.items():  # 2 000 examples a level: 4 standard errors is under 0.045
        assert abs(sum(hits) / len(hits) - carries.teacher_accuracy(level)) < 0.045, level
    assert all(ans == str(eval(q[:-1])) for q, ans in carries.warmup_examples(200, slip=0.0))  # noqa: S307


def test_references_resolve_to_the_task_and_its_policy():
    assert resolve_prompts("builtin:carries", 12, seed=4) == carries.train_prompts(12, seed=4)
    assert resolve_prompts("builtin:carries:heldout", 9) == carries.heldout_prompts(9)
    assert resolve_prompts("builtin:carries", 9, split="heldout") == carries.heldout_prompts(9)
    assert task_model("builtin:carries") == "builtin:tiny-carries" and TINY_MODELS["builtin:tiny-carries"] == "carries"
    assert task_model("builtin:arith:harder") == "builtin:tiny" and task_model("prompts.jsonl") is None
    with pytest.raises(ValueError, match="splits"):
        resolve_prompts("builtin:carries:harder", 4)


def test_policy_cache_keys_name_the_task_and_keep_builtin_tiny():
    arith, carry = tiny_spec(), tiny_spec(task="carries")
    assert "name" not in arith["task"] and arith["target"]["accuracy"] == 0.20  # builtin:tiny's key is unchanged
    assert carry["task"]["name"] == "carries" and tiny_dir(arith) != tiny_dir(carry)
    targets = warm_targets("carries")
    assert list(targets) == [0, 1, 2, 3] and all(targets[k] > targets[k + 1] > 0 for k in range(3))
