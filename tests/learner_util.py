"""Helpers of the learner tests: the tiny random Llama, hand-made curated rows, curated shards."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from rollstore.storage.buffer import Buffer, Part
from rollstore.storage.schema import CURATED

VOCAB = 32


def one_thread():
    """Generator body of an autouse fixture: tiny models run fastest (and reproducibly) on 1 thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float()


def curated_rows(
    curation_id: str, n: int, seed: int, model=None, mask_fraction: float = 0.8, empty_rows: int = 0
) -> pa.Table:
    """n curated rows with random prompts/responses, advantages ±1 and a random loss mask.

    old/gen log-probs are the model's own (on-policy) when a model is given, else −1.
    The last `empty_rows` rows get an all-false loss mask.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt = [1] + rng.integers(3, VOCAB, rng.integers(1, 5)).tolist()
        response = rng.integers(3, VOCAB, rng.integers(1, 6)).tolist() + [2]
        mask = (rng.random(len(response)) < mask_fraction).tolist()
        mask[0] = True
        if i >= n - empty_rows:
            mask = [False] * len(response)
        rows.append(
            {
                "curation_id": curation_id,
                "rollout_id": f"{curation_id}-r{i:03d}",
                "group_id": f"{curation_id}-g{i // 4}",
                "prompt_id": f"p{i // 4}",
                "policy_version": 0,
                "prompt_token_ids": prompt,
                "response_token_ids": response,
                "old_logprobs": [-1.0] * len(response),
                "gen_logprobs": [-1.0] * len(response),
                "advantage": 1.0 if i % 2 == 0 else -1.0,
                "loss_mask": mask,
                "weight": 1.0,
            }
        )
    table = pa.Table.from_pylist(rows, schema=CURATED)
    if model is not None:
        table = with_model_logprobs(table, model)
    return table


def with_model_logprobs(table: pa.Table, model) -> pa.Table:
    from rollstore.learner.batches import collate
    from rollstore.learner.trainer import response_logprobs

    batch = collate(table)
    with torch.no_grad():
        logp, _ = response_logprobs(model, batch, with_entropy=False)
    lists = [logp[i, : int(batch.lengths[i])].tolist() for i in range(len(batch))]
    arr = pa.array(lists, pa.list_(pa.float32()))
    table = table.set_column(table.schema.get_field_index("old_logprobs"), CURATED.field("old_logprobs"), arr)
    return table.set_column(table.schema.get_field_index("gen_logprobs"), CURATED.field("gen_logprobs"), arr)


def commit_curated(buf: Buffer, curation_id: str, tables: list[pa.Table]) -> list[str]:
    """One commit of a curation's shards (named part-00000, ...); returns their relative paths."""
    parts = [
        Part("curated", t, key=curation_id, subdir=curation_id, name=f"part-{k:05d}") for k, t in enumerate(tables)
    ]
    _, shards = buf.commit(parts, "curate", {"curation_id": curation_id})
    return [s.path for s in shards]
