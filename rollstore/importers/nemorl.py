"""`nemo-rl`: NeMo-RL's training dumps, `train_data_step{N}.jsonl`.

Follows the writer in NeMo-RL at 7ea279ab: the "Logging" block of `grpo_train` (and of
`async_grpo_train`) in `nemo_rl/algorithms/grpo.py` builds `log_data` (`content`, `rewards`,
`input_lengths`, `token_ids`, `token_loss_mask`, `sample_loss_mask`, `advantages`,
`generation_logprobs`, `prev_logprobs`; `agent_ref` and, with dynamic sampling, `filtered_rewards`
when present) and hands it to `Logger.log_batched_dict_as_jsonl` (`nemo_rl/utils/logger.py`),
which iterates `make_microbatch_iterator(1)`: every line is a batch of ONE sample, so every value
is wrapped in a list of length one (`"rewards": [1.0]`, `"input_lengths": [12]`,
`"token_ids": [[...]]`, `"content": [["prompt", "response"]]`), plus `"idx"`, the sample's
index. `token_ids` is the whole sequence (prompt then response) padded to the batch's longest;
the per-token lists run over the same positions.

Invariants:
- A line whose values are not batches of one (other than `idx`) is refused naming the line and
  the field: the importer reads the layout NeMo-RL writes, not a flattened one.
- The response is the loss-masked span within `input_lengths` (`tokens.response_span`);
  `gen_logprobs` is `generation_logprobs`, `old_logprobs` `prev_logprobs`, cut to it.
- `rollout_id` is a hash of the file's bytes, the step (the N of the file name: it is not in the
  bytes, so two byte-identical dumps of different steps are different rows) and the line number;
  importing a file again adds nothing.
- Groups are rebuilt from order (consecutive rows with the same prompt tokens: NeMo-RL repeats
  each prompt `num_generations_per_prompt` times in a row, `repeat_interleave`),
  `policy_version` is the step, `finish_reason` is inferred from the tokenizer's eos, text is
  decoded with `--tokenizer`; all recorded as lossy. Per-token advantages, `sample_loss_mask`,
  `idx` and `filtered_rewards` are kept in `meta`.
- An empty file is refused as empty; a null or non-integer token id, a non-number reward or
  log-prob is refused naming the line and the field.
"""

from __future__ import annotations

import os
import re

from rollstore.storage.importer import read_jsonl_objects
from .common import (Rows, TextCodec, bad, empty, file_digest, file_time, finish_from_eos, float_list,
                     groups_from_order, int_list, kind, missing, number, stable_id)
from .tokens import response_span

FORMAT = "nemo-rl"
_NAME = re.compile(r"train_data_step(\d+)\.jsonl$")
_REQUIRED = (("token_ids", "prompt_token_ids (token_ids)"), ("token_loss_mask", "token_loss_mask"),
             ("generation_logprobs", "gen_logprobs (generation_logprobs)"), ("rewards", "reward (rewards)"))


def _unwrap(obj: dict, path: str, lineno: int) -> dict:
    """One sample from a batch-of-one line: each value's single element."""
    out = {}
    for key, value in obj.items():
        if key == "idx":
            out[key] = value
            continue
        if not isinstance(value, list) or len(value) != 1:
            raise bad(FORMAT, path, f"line {lineno}", key, "expected a batch of one (a list holding one value, as "
                      f"Logger.log_batched_dict_as_jsonl writes), got {kind(value)}")
        out[key] = value[0]
    return out


def convert(path: str, codec: TextCodec | None, run_id: str) -> Rows:
    m = _NAME.search(os.path.basename(path))
    if m is None:
        raise missing(FORMAT, path, "step", "the file name must be train_data_step<N>.jsonl")
    step = int(m.group(1))
    lines = read_jsonl_objects(path)
    if not lines:
        raise empty(FORMAT, path)
    if codec is None:
        raise missing(FORMAT, path, "prompt", "the format holds token ids only; pass --tokenizer DIR to decode them")
    for name, field in _REQUIRED:
        for lineno, obj in lines:
            if name not in obj:
                raise bad(FORMAT, path, f"line {lineno}", field, "missing required field")
    digest = file_digest(path)
    rows = Rows(FORMAT, path)
    rids, p_ids, r_ids, gen, old, rewards, meta = [], [], [], [], [], [], []
    for lineno, raw in lines:
        obj = _unwrap(raw, path, lineno)
        at = f"line {lineno}"
        rid = stable_id(FORMAT, digest, step, lineno)
        ids = int_list(FORMAT, path, at, "token_ids", obj["token_ids"])
        length = obj.get("input_lengths", len(ids))
        if isinstance(length, bool) or not isinstance(length, int) or not 0 < length <= len(ids):
            raise bad(FORMAT, path, at, "input_lengths", f"expected an integer in 1..{len(ids)}, got {kind(length)}")
        mask = obj["token_loss_mask"]
        if not isinstance(mask, list) or len(mask) < length:
            raise bad(FORMAT, path, at, "token_loss_mask", f"expected a list of at least {length} values, got {kind(mask)}")
        start, end = response_span(mask[:length], path, at, FORMAT, "token_loss_mask")
        rids.append(rid)
        p_ids.append(ids[:start])
        r_ids.append(ids[start:end])
        gen.append(_logprobs(float_list(FORMAT, path, at, "generation_logprobs", obj["generation_logprobs"], end)[start:end],
                             path, at, "generation_logprobs"))
        prev = obj.get("prev_logprobs")
        old.append(None if prev is None else float_list(FORMAT, path, at, "prev_logprobs", prev, end)[start:end])
        rewards.append(number(FORMAT, path, at, "rewards", obj["rewards"]))
        adv = obj.get("advantages")
        meta.append({"advantages": adv[start:end] if isinstance(adv, list) else None,
                     "sample_loss_mask": obj.get("sample_loss_mask"), "idx": obj.get("idx"),
                     **({"filtered_rewards": obj["filtered_rewards"]} if "filtered_rewards" in obj else {})})
    gidx = groups_from_order([tuple(p) for p in p_ids])
    rows.note("group rebuilt from order (consecutive rows with the same prompt tokens)")
    rows.note("policy_version is the step")
    rows.note("prompt and response text decoded from token ids")
    prompts = [codec.decode(p) for p in p_ids]
    rows.identify(rids, gidx, prompts, run_id, [step] * len(rids))
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


def _logprobs(values: list, path: str, at: str, name: str) -> list[float]:
    if any(v is None for v in values):
        raise bad(FORMAT, path, at, name, "null log-prob inside the response")
    return values
