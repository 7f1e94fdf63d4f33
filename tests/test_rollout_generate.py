"""Generation on the tiny policy: the backend contract, sampler/trainer log-prob agreement, EOS
masks, determinism, speed, and the full generate_step → rollouts table → buffer path."""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

from rollstore.learner.policy_loading import load_policy
from rollstore.learner.score import score
from rollstore.rollout import arith
from rollstore.rollout.backends import cut_at_first_eos, get_backend
from rollstore.rollout.backends.hf import HFBackend
from rollstore.loop.generate import GenerationConfig, StepStamp, generate_step
from rollout_helpers import default_tiny, small_tiny, tiny_cache, untrained_tiny  # noqa: F401
from rollstore.storage.schema import ROLLOUTS
from rollstore.storage.validate import validate_rollouts

PROMPTS = [p.prompt for p in arith.train_prompts(64, seed=0)]


@pytest.fixture(scope="module")
def untrained_backend(untrained_tiny):  # noqa: F811
    return HFBackend(untrained_tiny)


def flat(groups):
    return [g for group in groups for g in group]


def max_logprob_gap(model_dir, gens):
    model, tok = load_policy(model_dir)
    old, _ = score(model, tok, [g.prompt_token_ids for g in gens], [g.response_token_ids for g in gens])
    return max(float(np.abs(o - g.gen_logprobs).max()) for o, g in zip(old, gens) if len(o))


def test_gen_logprobs_equal_trainer_logprobs(default_tiny, untrained_tiny):  # noqa: F811
    for model_dir in (default_tiny, untrained_tiny):
        gens = flat(HFBackend(model_dir).generate(PROMPTS, 8, 12, temperature=1.0, top_p=1.0, seed=1))
        assert max_logprob_gap(model_dir, gens) < 1e-4


def test_sampler_scores_equal_the_learners_at_any_temperature(default_tiny, untrained_tiny):  # noqa: F811
    """The fp32 HF sampler's own untempered log-probs and entropies are what `learner.score` computes,
    so generate_step can skip the second forward pass."""
    for model_dir in (default_tiny, untrained_tiny):
        for temperature in (1.0, 0.7):
            gens = flat(HFBackend(model_dir).generate(PROMPTS[:24], 4, 12, temperature=temperature, seed=2))
            model, tok = load_policy(model_dir)
            old, ent = score(model, tok, [g.prompt_token_ids for g in gens], [g.response_token_ids for g in gens])
            for o, e, g in zip(old, ent, gens):
                assert len(g.policy_logprobs) == len(g.entropies) == len(g.response_token_ids) == len(o)
                assert np.allclose(o, g.policy_logprobs, atol=1e-4) and np.allclose(e, g.entropies, atol=1e-4)
            if temperature != 1.0:  # gen_logprobs stay those of the tempered distribution
                assert max(float(np.abs(g.gen_logprobs - g.policy_logprobs).max()) for g in gens if len(g.gen_logprobs)) > 1e-3


def test_masks_come_from_the_first_eos(untrained_backend):
    be = untrained_backend
    pad, eos = be.tokenizer.pad_token_id, be.tokenizer.eos_token_id
    gens = flat(be.generate(PROMPTS[:32], 8, 12, seed=0))
    assert {g.finish_reason for g in gens} == {"stop", "length"}
    for g in gens:
        toks = g.response_token_ids
        assert eos not in toks[:-1]  # nothing kept after the first EOS
        if g.finish_reason == "stop":
            assert toks[-1] == eos
        else:
            assert len(toks) == 12 and eos not in toks
        assert len(g.gen_logprobs) == len(toks) and g.gen_logprobs.dtype == np.float32
        assert (g.gen_logprobs <= 0).all()
    # An untrained policy samples the pad token mid-sequence: a `!= pad` mask would cut these short.
    assert any(pad in g.response_token_ids[:-1] for g in gens)


def test_cut_at_first_eos_rule():
    lp = np.array([-1, -2, -3, -4, -5], dtype=np.float32)
    assert cut_at_first_eos([5, 0, 2, 7, 2], lp, [2], 5)[0] == [5, 0, 2]  # pad (0) is not an end
    toks, lps, reason = cut_at_first_eos([5, 6, 7, 8, 9], lp, [2], 4)
    assert (toks, list(lps), reason) == ([5, 6, 7, 8], [-1, -2, -3, -4], "length")


def test_same_seed_same_rollouts(small_tiny):  # noqa: F811
    be = HFBackend(small_tiny)
    a = flat(be.generate(PROMPTS[:16], 4, 12, seed=7))
    b = flat(be.generate(PROMPTS[:16], 4, 12, seed=7))
    c = flat(be.generate(PROMPTS[:16], 4, 12, seed=8))
    assert [g.response_token_ids for g in a] == [g.response_token_ids for g in b]
    assert all(np.array_equal(x.gen_logprobs, y.gen_logprobs) for x, y in zip(a, b))
    assert [g.response_token_ids for g in a] != [g.response_token_ids for g in c]
    # The backend leaves the caller's torch RNG alone.
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    be.generate(PROMPTS[:2], 2, 4, seed=0)
    assert torch.equal(torch.rand(1), before)


def test_temperature_logprobs_and_greedy(small_tiny):  # noqa: F811
    be = HFBackend(small_tiny)
    gens = flat(be.generate(PROMPTS[:8], 4, 12, temperature=0.7, top_p=0.9, seed=3))
    model = be.model
    for g in gens[:12]:
        ids = torch.tensor([g.prompt_token_ids + g.response_token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        n = len(g.prompt_token_ids)
        rows = torch.log_softmax(logits[n - 1 : n - 1 + len(g.response_token_ids)] / 0.7, dim=-1)
        want = rows[torch.arange(len(g.response_token_ids)), torch.tensor(g.response_token_ids)]
        np.testing.assert_allclose(g.gen_logprobs, want.numpy(), atol=1e-4)
    greedy = be.generate(PROMPTS[:8], 3, 12, temperature=0.0)
    for group in greedy:
        assert len({tuple(g.response_token_ids) for g in group}) == 1
    assert max_logprob_gap(small_tiny, flat(greedy)) < 1e-4


def test_64_prompts_by_8_samples_in_seconds(default_tiny):  # noqa: F811
    be = get_backend("hf", default_tiny)
    t0 = time.perf_counter()
    groups = be.generate(PROMPTS, 8, 12, seed=0)
    elapsed = time.perf_counter() - t0
    assert len(groups) == 64 and all(len(g) == 8 for g in groups)
    assert elapsed < 15, f"64x8 generation took {elapsed:.1f}s"


def test_contract_errors(untrained_backend):
    with pytest.raises(ValueError, match="group_size"):
        untrained_backend.generate(["1+1="], 0, 4)
    with pytest.raises(ValueError, match="top_p"):
        untrained_backend.generate(["1+1="], 1, 4, top_p=0.0)
    with pytest.raises(ValueError, match="unknown generation backend"):
        get_backend("tgi", "x")
    assert untrained_backend.generate([], 4, 4) == []


@pytest.fixture(scope="module")
def step_table(default_tiny):  # noqa: F811
    prompts = arith.train_prompts(24, seed=5)
    return prompts, generate_step(default_tiny, prompts, StepStamp("run-a", 3, policy_version=2),
                                  GenerationConfig(group_size=6, seed=11, max_new_tokens=12))


def test_generate_step_builds_valid_scored_rollouts(step_table):
    prompts, table = step_table
    assert table.schema == ROLLOUTS
    validate_rollouts(table, "generate_step")  # the append-time rules of docs/schema.md
    rows = table.to_pylist()
    assert len(rows) == 24 * 6
    assert len({r["rollout_id"] for r in rows}) == len(rows)
    assert len({r["group_id"] for r in rows}) == 24
    assert rows[0]["group_id"] == "run-a-s000003-p00000" and rows[0]["rollout_id"].endswith("-000")
    by_prompt = {p.prompt_id: p for p in prompts}
    for r in rows:
        p = by_prompt[r["prompt_id"]]
        assert (r["prompt"], r["gold_answer"], r["source"]) == (p.prompt, p.gold_answer, "builtin:arith")
        assert (r["run_id"], r["step"], r["policy_version"]) == ("run-a", 3, 2)
        assert r["correct"] == (r["response"].strip() == p.gold_answer)  # integers: exact match
        assert r["reward"] == (1.0 if r["correct"] else 0.0) and r["verify_error"] is None
        assert len(r["old_logprobs"]) == len(r["entropies"]) == len(r["response_token_ids"])
        np.testing.assert_allclose(r["old_logprobs"], r["gen_logprobs"], atol=1e-4)
        assert min(r["entropies"], default=0) >= 0
        meta = json.loads(r["meta"])
        assert meta["backend"] == "hf" and meta["temperature"] == 1.0 and meta["difficulty"] == p.difficulty
    assert table.column("created_at").type == pa.timestamp("us", tz="UTC")
    accuracy = np.mean([r["correct"] for r in rows])
    assert 0.05 < accuracy < 0.95  # the warm-started policy gives groups with something to learn


def test_generate_step_is_deterministic_and_can_skip_scoring(default_tiny, step_table):  # noqa: F811
    prompts, table = step_table
    again = generate_step(default_tiny, prompts,
                          StepStamp("run-a", 3, policy_version=2, created_at=table.column("created_at")[0].as_py()),
                          GenerationConfig(group_size=6, seed=11, max_new_tokens=12, score=False))
    assert again.column("old_logprobs").null_count == again.num_rows
    assert again.column("entropies").null_count == again.num_rows
    same = ["rollout_id", "response_token_ids", "gen_logprobs", "reward", "correct", "created_at"]
    assert again.select(same).equals(table.select(same))


def test_appends_to_the_buffer_and_reads_back(step_table, tmp_path):
    buffer = pytest.importorskip("rollstore.storage.buffer")
    _, table = step_table
    root = str(tmp_path / "buf")
    buffer.Buffer.init(root).close()
    with buffer.Buffer.open(root) as buf:
        buf.append_rollouts(table, source="generate_step")
    with buffer.Buffer.open(root) as buf:
        back = buf.snapshot().arrow("rollouts").to_table()
    assert back.num_rows == table.num_rows
    back = back.sort_by("rollout_id")
    orig = table.sort_by("rollout_id")
    for col in ("rollout_id", "response_token_ids", "gen_logprobs", "old_logprobs", "reward", "correct"):
        assert back.column(col).to_pylist() == orig.column(col).to_pylist(), col
