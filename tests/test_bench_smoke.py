"""Smoke test of the benchmark entry points at a tiny size: the tables have their rows and columns.

No timing is asserted (the machine is shared); child processes are replaced by in-process calls
of the same child functions so that the whole file runs in seconds.
"""

from __future__ import annotations

import pytest

from bench import common, curation, growth, learner_input, memory, storage


def _columns(table: str) -> int:
    return table.splitlines()[0].count("|") - 1


def _body(table: str) -> list[str]:
    return [ln for ln in table.splitlines()[2:] if ln.startswith("|")]


@pytest.fixture
def in_process(monkeypatch):
    """run_one → the child function in this process (no fresh interpreter per measurement)."""

    def run_one(kind, root, recipe="", memory_limit="1GB", progress="0", where="true", out=None, profile=False,
                first_shards=0, ids=None):
        if kind == "floor":
            r = curation.child_floor(root, memory_limit, where)
        elif kind in ("curate", "dry"):
            r = curation.child_curate(root, recipe, memory_limit, progress, where, out, profile, kind == "dry")
        elif kind == "copy":
            r = curation.child_copy(root, memory_limit, ids, out)
        else:
            r = curation.child_reference(root, recipe, progress, out, profile, first_shards or None)
        r.setdefault("peak_rss_mib", common.peak_rss_mib())
        return r

    for mod in (curation, growth, memory):
        monkeypatch.setattr(mod, "run_one", run_one)
    return run_one


@pytest.fixture
def small_buffer(tmp_path):
    root = str(tmp_path / "buf")
    info = common.build_buffer(root, 20_000, shard_tokens=4_000)
    assert info["shards"] >= 4
    return root


def test_storage_table(tmp_path):
    m = storage.measure(12_000, shard_tokens=4_000, workdir=str(tmp_path))
    table = storage.tables(m)
    assert _columns(table) == 10
    assert len(_body(table)) == len(storage.FORMATS) + 1  # + Arrow in memory
    r = storage.ratios(m)
    assert 0 < r["size_vs_jsonl"] < 1  # smaller than JSONL (a size, not a timing)
    assert "Method." in storage.section(m)


def test_curation_tables_and_agreement(small_buffer, in_process, tmp_path):
    m = curation.measure(small_buffer, ["d3s", "da3po"], workdir=str(tmp_path / "agr"))
    text = curation.tables(m)
    tables = text.split("\n\n")
    main = next(t for t in tables if t.startswith("| run |"))
    assert _columns(main) == 8
    assert len(_body(main)) == 1 + 2 * 4  # floor + (reference, copy floor, dry run, rollstore) per recipe
    for recipe, v in m["recipes"].items():  # the dry run gives the full run's numbers
        assert (v["dry"]["n_selected"], v["dry"]["tokens_kept"]) == (v["rollstore"]["n_selected"],
                                                                      v["rollstore"]["tokens_kept"]), recipe
        assert v["copy"]["bytes"] > 0
    targets = curation.targets(m)
    assert len(targets) == 4 * 2 + 1 and all(x > 0 for _, x, _ in targets)
    assert set(m["growth"]) == {"1-step buffer", f"{m['info']['shards']}-step buffer"}
    for recipe, v in m["recipes"].items():
        a = v["agreement"]
        assert a["same_rollouts"], recipe
        assert a["tokens_kept"][0] == a["tokens_kept"][1], recipe
        assert a["rows_same_tokens_kept"] == 1.0, recipe
    assert set(curation.ratios(m)) == {"d3s", "da3po"}
    assert "materialise + write + commit" in text


def test_growth_table(small_buffer, in_process):
    m = growth.measure(small_buffer, ["d3s"], base_steps=1)
    table = growth.tables(m)
    assert _columns(table) == 3 + 3 + 1  # batch, tokens, rollouts; floor, reference, d3s; work
    assert len(_body(table)) == 3 + 1  # 1×, 2×, 4× + the exponent


def test_memory_table(tmp_path, in_process):
    m = memory.measure([4_000, 8_000, 16_000], ["d3s"], memory_limit="64MB", shard_tokens=4_000,
                       root=str(tmp_path / "mem"), reference_limit="1GB")
    table = memory.tables(m).split("\n\n")[0]
    assert _columns(table) == 14
    assert len(_body(table)) == 3 + 1
    assert set(m["slopes"]) == {"d3s"}


def test_learner_input_paths_agree(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t = learner_input.tiny_rollouts(64, mean_tokens=8)
    ids = t.column("response_token_ids").combine_chunks().values.to_numpy()
    assert ids.min() >= 4 and ids.max() < 24
    shards = learner_input.prepare(str(tmp_path / "buf"), 64, 8, "d3s", "0.5")
    assert shards
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, head_dim=16, max_position_embeddings=64))
    r = learner_input.child(shards, repeat=1, prof=False, model=model)
    assert r["same_weights"]
    assert r["tokens"] > 0 and r["steps"] >= 1
    r.update({"candidates": 64, "mean_tokens": 8, "recipe": "d3s", "progress": "0.5", "repeat": 1, "n_shards": 1})
    table = learner_input.tables(r).split("\n\n")[0]
    assert _columns(table) == 5
    assert len(_body(table)) == 3
