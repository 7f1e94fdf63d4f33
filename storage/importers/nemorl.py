"""`nemo-rl`: NeMo-RL's training dumps, `train_data_step{N}.jsonl`.

Follows the writer in NeMo-RL's `nemo_rl/algorithms/grpo.py` (the "Logging" block of
`grpo_train`, through `Logger.log_batched_dict_as_jsonl` in `nemo_rl/utils/logger.py`): one JSON
object per sample of the step, with `token_ids` (the whole padded sequence, prompt then
response), `input_lengths` (its unpadded length), `token_loss_mask`, `generation_logprobs`,
`prev_logprobs` and `advantages` (per token over the whole sequence), `rewards` (one per sample),
`sample_loss_mask`, and `content` (the message text) when logged.

Invariants:
- The response is the loss-masked span within `input_lengths` (`tokens.response_span`);
  `gen_logprobs` is `generation_logprobs`, `old_logprobs` `prev_logprobs`, cut to it.
- `rollout_id` is a hash of the file's bytes, the step (the N of the file name: it is not in the
  bytes, so two byte-identical dumps of different steps are different rows) and the line number;
  importing a file again adds nothing.
- Groups are rebuilt from order (consecutive rows with the same prompt tokens: NeMo-RL repeats
  each prompt `num_generations_per_prompt` times in a row), `policy_version` is the step,
  `finish_reason` is inferred from the tokenizer's eos, text is decoded with `--tokenizer`;
  all recorded as lossy. Per-token advantages and `sample_loss_mask` are kept in `meta`.
"""

from __future__ import annotations

import os
import re

from ..importer import read_jsonl_objects
from .common import (Rows, TextCodec, file_digest, file_time, finish_from_eos, group_ids,
                     groups_from_order, missing, sample_idx, stable_id)
from .tokens import per_token, response_span

FORMAT = "nemo-rl"
_NAME = re.compile(r"train_data_step(\d+)\.jsonl$")


def convert(path: str, codec: TextCodec | None, run_id: str) -> Rows:
    m = _NAME.search(os.path.basename(path))
    if m is None:
        raise missing(FORMAT, path, "step", "the file name must be train_data_step<N>.jsonl")
    step = int(m.group(1))
    lines = read_jsonl_objects(path)
    if codec is None:
        raise missing(FORMAT, path, "prompt", "the format holds token ids only; pass --tokenizer DIR to decode them")
    for name, field in (("token_ids", "prompt_token_ids (token_ids)"), ("token_loss_mask", "token_loss_mask"),
                        ("generation_logprobs", "gen_logprobs (generation_logprobs)"), ("rewards", "reward (rewards)")):
        if any(name not in obj for _, obj in lines):
            raise missing(FORMAT, path, field)
    digest = file_digest(path)
    rows = Rows(FORMAT, path)
    rids, p_ids, r_ids, gen, old, rewards, meta = [], [], [], [], [], [], []
    for lineno, obj in lines:
        rid = stable_id(FORMAT, digest, step, lineno)
        length = obj.get("input_lengths", len(obj["token_ids"]))
        mask = obj["token_loss_mask"][:length]
        start, end = response_span(mask, path, rid, FORMAT, "token_loss_mask")
        ids = per_token(obj, "token_ids", end, path, rid, FORMAT)
        rids.append(rid)
        p_ids.append(ids[:start])
        r_ids.append(ids[start:end])
        gen.append(per_token(obj, "generation_logprobs", end, path, rid, FORMAT)[start:end])
        old.append(per_token(obj, "prev_logprobs", end, path, rid, FORMAT)[start:end] if "prev_logprobs" in obj else None)
        rewards.append(obj["rewards"])
        meta.append({"advantages": obj["advantages"][start:end] if obj.get("advantages") is not None else None,
                     "sample_loss_mask": obj.get("sample_loss_mask")})
    gidx = groups_from_order([tuple(p) for p in p_ids])
    rows.note("group rebuilt from order (consecutive rows with the same prompt tokens)")
    rows.note("policy_version is the step")
    rows.note("prompt and response text decoded from token ids")
    prompts = [codec.decode(p) for p in p_ids]
    rows.set("rollout_id", rids)
    rows.set("group_id", group_ids(FORMAT, gidx, rids))
    rows.set("prompt_id", [stable_id("prompt", p) for p in prompts])
    rows.set("sample_idx", sample_idx(gidx))
    rows.set("run_id", [run_id] * len(rids))
    rows.set("step", [step] * len(rids))
    rows.set("policy_version", [step] * len(rids))
    rows.set("prompt", prompts)
    rows.set("prompt_token_ids", p_ids)
    rows.set("response", [codec.decode(r) for r in r_ids])
    rows.set("response_token_ids", r_ids)
    rows.set("gen_logprobs", gen)
    rows.set("old_logprobs", old)
    rows.set("finish_reason", finish_from_eos(r_ids, codec, rows))
    rows.set("reward", rewards)
    rows.set("created_at", [file_time(path)] * len(rids))
    rows.extra_meta = meta
    return rows
