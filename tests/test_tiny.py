"""builtin:tiny: tokenizer, deterministic warm start, the cache, and the default accuracy band."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

from rollstore.learner.policy_loading import load_policy
from rollstore.learner.tiny import build_tiny, build_tokenizer
from rollstore.rollout import arith
from rollout_helpers import SMALL_STEPS, default_tiny, small_tiny, tiny_cache  # noqa: F401
from rollstore.builtin import resolve, shipped
from rollstore.builtin.resolve import (TINY_INFO, TINY_MODELS, WARM_TARGET, resolve_model, resolve_prompts,
                                       tiny_dir, tiny_info, tiny_spec)
from rollstore.storage.errors import RollstoreError


def test_character_tokenizer_round_trips(tmp_path):
    tok = build_tokenizer()
    ids = tok("12+7= -3*4")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 11
    assert tok.decode(ids, skip_special_tokens=True) == "12+7= -3*4"
    tok.save_pretrained(tmp_path)
    for loaded in (PreTrainedTokenizerFast.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)):
        assert loaded("12+7= -3*4")["input_ids"] == ids
        assert loaded.decode(ids[1:] + [tok.eos_token_id], skip_special_tokens=True) == "12+7= -3*4"
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3


def test_build_is_deterministic_by_seed(tmp_path):
    ex = arith.warmup_examples(200, seed=0)
    build_tiny(str(tmp_path / "a"), ex, steps=3, seed=5)
    build_tiny(str(tmp_path / "b"), ex, steps=3, seed=5)
    build_tiny(str(tmp_path / "c"), ex, steps=3, seed=6)
    a, b, c = (load_policy(str(tmp_path / k))[0].state_dict() for k in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    cfg = AutoConfig.from_pretrained(tmp_path / "a")
    assert cfg.model_type == "llama" and cfg.head_dim == 64
    assert cfg.hidden_size // cfg.num_attention_heads == 64


def test_resolve_model_caches_and_reuses(small_tiny, tiny_cache):  # noqa: F811
    assert small_tiny.startswith(tiny_cache) and os.path.basename(small_tiny).startswith("tiny-")
    stamp = os.path.getmtime(os.path.join(small_tiny, "model.safetensors"))
    t0 = time.perf_counter()
    again = resolve_model("builtin:tiny", steps=SMALL_STEPS, quiet=True)
    assert again == small_tiny and time.perf_counter() - t0 < 2.0
    assert os.path.getmtime(os.path.join(small_tiny, "model.safetensors")) == stamp
    assert not [d for d in os.listdir(tiny_cache) if d.startswith(".tiny-building-")]
    info = tiny_info(small_tiny)
    assert info["spec"]["steps"] == SMALL_STEPS and 0 <= info["heldout"]["accuracy"] <= 1
    assert resolve_model(small_tiny) == small_tiny  # an existing directory is used as is


def test_resolve_model_errors(tmp_path):
    with pytest.raises(RollstoreError, match="no such model directory"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(RollstoreError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_resolve_prompts(tmp_path):
    assert resolve_prompts("builtin:arith", 10, seed=1) == arith.train_prompts(10, seed=1)
    assert resolve_prompts("builtin:arith", 10, split="heldout") == arith.heldout_prompts(10)
    assert {p.difficulty for p in resolve_prompts("builtin:arith:harder", 8)} == set(arith.SPLITS["harder"])
    # the loop asks a split's ref for its held-out prompts: those of the same split, never training ones
    assert resolve_prompts("builtin:arith:harder", 10, split="heldout") == arith.heldout_prompts(10, split="harder")
    assert resolve_prompts("builtin:arith:train", 10, split="heldout") == arith.heldout_prompts(10)
    assert resolve_prompts("builtin:arith:heldout", 10, split="train") == arith.heldout_prompts(10)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(5)))
    assert len(resolve_prompts(str(path))) == 5
    picked = resolve_prompts(str(path), 12, seed=2)
    assert len(picked) == 12 and picked == resolve_prompts(str(path), 12, seed=2)


def test_default_warm_start_trains_to_its_target(default_tiny):  # noqa: F811
    """Trained to a target, not for a step count: on any CPU the start lands where groups are mixed.
    (The session's builtin:tiny is the shipped copy of that build; test_a_build_trains_to_its_target
    runs the same path to a lower target.)"""
    info = tiny_info(default_tiny)
    last = info["checks"][-1]
    assert info["warm_start"]["steps"] == last["step"] <= info["warm_start"]["max_steps"]
    stopped_at_target = min(last["sampled_per_level"].values()) >= WARM_TARGET
    assert stopped_at_target or last["step"] == info["warm_start"]["max_steps"]  # here: the target, at 2 100 of 3 000
    held = info["heldout"]
    assert set(held["sampled_per_level"]) == {str(k) for k in arith.LEVELS}
    assert all(0.10 <= v <= 0.70 for v in held["sampled_per_level"].values()), held
    assert held["accuracy"] <= 0.5, held  # greedy follows the teacher's slip: room for RL


def test_a_build_trains_to_its_target(tiny_cache, monkeypatch):  # noqa: F811
    """The build behind builtin:tiny (no shipped copy for this key), to a target every level reaches
    within a few hundred steps: it stops at the first check that meets it, having learnt."""
    monkeypatch.setattr(resolve, "WARM_TARGET", 0.01)
    monkeypatch.setattr(resolve, "WARM_CHECK_EVERY", 50)
    path = resolve_model("builtin:tiny", quiet=True)
    info = tiny_info(path)
    assert info["spec"]["target"]["accuracy"] == 0.01 and not os.path.exists(os.path.join(path, shipped.MANIFEST))
    steps, checks = info["warm_start"]["steps"], info["checks"]
    assert [c["step"] for c in checks] == list(range(50, steps + 1, 50)) and steps < info["warm_start"]["max_steps"]
    assert min(checks[-1]["sampled_per_level"].values()) >= 0.01  # stopped at the first check that met it
    assert not any(min(c["sampled_per_level"].values()) >= 0.01 for c in checks[:-1])
    assert info["warm_start"]["final_loss"] < 2.0 and info["heldout"]["sampled"] > 0.01


def test_the_shipped_policies_are_builds_of_the_current_keys():
    """Each built-in policy's default build ships, for the key the code computes now (make tiny-models)."""
    keys = {os.path.basename(tiny_dir(tiny_spec(task=task))): task for task in TINY_MODELS.values()}
    assert sorted(os.listdir(shipped.SHIPPED_ROOT)) == sorted(keys)
    for name, task in keys.items():
        path = os.path.join(shipped.SHIPPED_ROOT, name)
        assert shipped.why_not(path, tiny_spec(task=task)) is None
        assert tiny_info(path)["warm_start"]["steps"] <= tiny_info(path)["warm_start"]["max_steps"]


def _corrupt(path, how):
    if how == "bytes":
        with open(os.path.join(path, "model.safetensors"), "r+b") as fh:
            fh.seek(-5, os.SEEK_END)
            last = fh.read(1)
            fh.seek(-5, os.SEEK_END)
            fh.write(bytes([last[0] ^ 1]))
        return "model.safetensors: sha256 differs"
    if how == "extra":
        open(os.path.join(path, "pytorch_model.bin"), "wb").close()
        return "are not the"
    if how == "missing":
        os.remove(os.path.join(path, "tokenizer.json"))
        return "are not the"
    # another spec's build under this key, its manifest consistent with it
    info_path = os.path.join(path, TINY_INFO)
    with open(info_path) as fh:
        info = json.load(fh)
    info["spec"]["seed"] = 1
    with open(info_path, "w") as fh:
        json.dump(info, fh)
    manifest_path = os.path.join(path, shipped.MANIFEST)
    with open(manifest_path) as fh:
        manifest = json.load(fh)
    manifest["sha256"][TINY_INFO] = hashlib.sha256(open(info_path, "rb").read()).hexdigest()
    with open(manifest_path, "w") as fh:
        json.dump(manifest, fh)
    return "another spec"


@pytest.mark.parametrize("how", ["intact", "bytes", "extra", "missing", "spec"])
def test_a_shipped_copy_is_installed_only_intact(how, tmp_path, monkeypatch, capsys):
    """The first use installs the shipped copy, verified; an altered one is refused, said on stderr,
    and the policy is built instead (build_tiny stubbed: the build is tested above)."""
    import rollstore.learner.tiny as tiny

    models = tmp_path / "models"
    shutil.copytree(shipped.SHIPPED_ROOT, models)
    name = os.path.basename(tiny_dir(tiny_spec()))
    reason = None if how == "intact" else _corrupt(str(models / name), how)
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", str(models))
    monkeypatch.setenv("ROLLSTORE_CACHE", str(tmp_path / "cache"))

    def stop(*args, **kwargs):
        raise RuntimeError("stopped by the test once the build began")

    monkeypatch.setattr(tiny, "build_tiny", stop)
    if reason is None:
        path = resolve_model("builtin:tiny")
        assert path == str(tmp_path / "cache" / name) and shipped.why_not(path, tiny_spec()) is None
        assert capsys.readouterr().err == ""  # nothing built, nothing to say
        assert sorted(os.listdir(tmp_path / "cache")) == [name]
        return
    with pytest.raises(RuntimeError, match="stopped by the test"):
        resolve_model("builtin:tiny")
    err = capsys.readouterr().err.splitlines()
    assert "the shipped copy" in err[0] and "is refused" in err[0] and reason in err[0], err
    assert err[1].startswith("builtin:tiny: building the built-in policy once")
    assert os.listdir(tmp_path / "cache") == []  # neither the refused copy nor a partial build stays
