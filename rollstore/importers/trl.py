"""`trl-completions`: TRL GRPOTrainer's `completions/completions_{step:05d}.parquet`.

Follows the writer in TRL 1.16's `trl/trainer/grpo_trainer.py` (`GRPOTrainer.log`, when
`log_completions` is on; the rows are gathered in `_generate_and_score_completions`): one Parquet
file per logging step, written with pandas `to_parquet`, with the columns `step`, `prompt`,
`completion`, one float column per reward function (named after it; NaN where the function
returned None), extra columns logged with `log_extra`, and `advantage`. Some versions add `mode`
(and write under `completions/<mode>/`). The rows come from deques of length
`generation_batch_size` that are never cleared, so a file repeats the rows of the previous file
when no new generation batch came in between (`steps_per_generation` > `logging_steps`), and
`step` is the step the file was written at, not the step of the generation.

A prompt is a string, or (conversational datasets) a list of messages `{"role", "content"}`; a
completion likewise a string or a list of assistant messages.

Invariants:
- Prompt ids are what TRL fed the model: a text prompt is tokenised with the tokenizer's special
  tokens (TRL calls `processing_class(text=prompts)`), a conversational prompt with the
  `--tokenizer`'s chat template, generation prompt added (`apply_chat_template(tokenize=True)`,
  as TRL does); `prompt` holds the rendered text. The response is the text of the completion
  (of its messages), encoded without special tokens (TRL logs it decoded with
  `skip_special_tokens=True`). A conversation with a tokenizer that has no chat template is refused.
- A row's identity is its content (the prompt and completion as logged, the reward columns, the
  advantage) plus its occurrence among identical rows of its group: two identical completions of
  one prompt are two rows (occurrence 0 and 1), and the same generation batch logged again in a
  later file gets the same ids and adds nothing. The step is not part of the id.
- `reward` is the sum of the reward columns (TRL's reward weights are not logged: weights of 1
  are assumed and recorded); each reward column and the advantage are kept in `meta`.
- Groups are rebuilt from order (consecutive rows with the same prompt: TRL's sampler repeats a
  prompt `num_generations` times in a row), `step` and `policy_version` are the file's step; both
  recorded as lossy.
- Rows of `mode` other than `train` are skipped. A file with no rows, a null or non-text prompt or
  completion, or a non-integer step is refused naming the row and the field.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from rollstore.storage.errors import ValidationError
from .common import (Rows, TextCodec, bad, empty, file_time, groups_from_order, kind, missing, stable_id)
from .text import fill_text

FORMAT = "trl-completions"
_NOT_REWARD = {"step", "prompt", "completion", "advantage", "mode", "image"}


def convert(path: str, codec: TextCodec | None, run_id: str) -> Rows:
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise ValidationError(path, None, None, f"{FORMAT}: not a readable Parquet file ({exc})") from None
    if table.num_rows == 0:
        raise empty(FORMAT, path)
    for name in ("step", "prompt", "completion"):
        if name not in table.column_names:
            raise missing(FORMAT, path, name)
    data = list(enumerate(table.to_pylist()))
    if "mode" in table.column_names:
        data = [(i, r) for i, r in data if r.get("mode") in (None, "train")]
    if not data:
        raise empty(FORMAT, path)
    reward_cols = [f.name for f in table.schema if f.name not in _NOT_REWARD
                   and (pa.types.is_floating(f.type) or pa.types.is_integer(f.type))]
    if not reward_cols:
        raise missing(FORMAT, path, "reward", "no reward function column in the file")
    rows = Rows(FORMAT, path)
    prompts, responses, keys, p_ids = [], [], [], []
    for i, r in data:
        prompts.append(_prompt(r["prompt"], codec, path, i))
        if codec is not None:
            if isinstance(r["prompt"], list):
                p_ids.append(codec.chat_ids([{"role": m.get("role"), "content": m["content"]} for m in r["prompt"]]))
            else:
                p_ids.append((codec.encode_prompt or codec.encode)(prompts[-1]))
        responses.append(_completion(r["completion"], path, i))
        keys.append(json.dumps(r["prompt"], sort_keys=True, ensure_ascii=False))
    gidx = groups_from_order(keys)
    seen: dict[tuple, int] = {}
    rids = []
    for g, key, (_, r) in zip(gidx, keys, data):
        content = (key, json.dumps(r["completion"], sort_keys=True, ensure_ascii=False),
                   [_plain(r.get(c)) for c in reward_cols], _plain(r.get("advantage")))
        k = seen.get((g, repr(content)), 0)
        seen[(g, repr(content))] = k + 1
        # occurrence 0 keeps the id of versions that had no occurrence (a re-import adds nothing)
        rids.append(stable_id(FORMAT, r["prompt"], r["completion"], content[2], content[3], *([k] if k else [])))
    if any(isinstance(r["prompt"], list) for _, r in data):
        rows.note("conversational prompts rendered with the tokenizer's chat template")
    rows.note("reward is the sum of the reward columns (reward weights assumed 1)")
    rows.note("group rebuilt from order (consecutive rows with the same prompt)")
    rows.note("step and policy_version are the step the file was written at")
    file_step = _step(data, path)
    rows.identify(rids, gidx, prompts, run_id, [file_step] * len(data))
    fill_text(rows, codec, prompts, responses, p_ids if codec is not None else None)
    rows.note("prompt tokenised as TRL tokenises it (special tokens added, or the chat template)")
    rewards = []
    for _, r in data:
        vals = [r.get(c) for c in reward_cols]
        # TRL logs NaN for a reward function that returned None for a sample; it adds nothing.
        rewards.append(float(sum(v for v in vals if v is not None and v == v)))
    rows.set("reward", rewards)
    rows.set("created_at", [file_time(path)] * len(data))
    rows.extra_meta = [{"rewards": {c: _plain(r.get(c)) for c in reward_cols}, "advantage": _plain(r.get("advantage")),
                        **({"messages": {"prompt": r["prompt"], "completion": r["completion"]}}
                           if isinstance(r["prompt"], list) or isinstance(r["completion"], list) else {})}
                       for _, r in data]
    return rows


def _plain(v):
    """NaN as None (JSON has no NaN; TRL writes NaN for a reward function's None)."""
    return None if isinstance(v, float) and v != v else v


def _messages_text(value, path: str, row: int, name: str) -> list[dict]:
    if not value or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
        raise bad(FORMAT, path, f"row {row}", name, f"expected a string or a list of messages with text "
                  f"`content`, got {kind(value)}")
    return value


def _prompt(value, codec: TextCodec | None, path: str, row: int) -> str:
    if isinstance(value, str):
        return value
    if value is None or not isinstance(value, list):
        raise bad(FORMAT, path, f"row {row}", "prompt", f"expected a string or a list of messages, got {kind(value)}")
    messages = _messages_text(value, path, row, "prompt")
    if codec is None:
        raise missing(FORMAT, path, "prompt_token_ids", "the format holds text only; pass --tokenizer DIR")
    if codec.chat is None:
        raise bad(FORMAT, path, f"row {row}", "prompt", "a conversation (list of messages), and the --tokenizer "
                  "has no chat template to render it with")
    return codec.chat([{"role": m.get("role"), "content": m["content"]} for m in messages])


def _completion(value, path: str, row: int) -> str:
    if isinstance(value, str):
        return value
    if value is None or not isinstance(value, list):
        raise bad(FORMAT, path, f"row {row}", "completion", f"expected a string or a list of messages, got {kind(value)}")
    return "".join(m["content"] for m in _messages_text(value, path, row, "completion"))


def _step(data: list, path: str) -> int:
    i, r = data[0]
    value = r["step"]
    try:
        if isinstance(value, bool) or value is None:
            raise TypeError
        return int(value)  # TRL writes it as an int (older versions: as text)
    except (TypeError, ValueError):
        raise bad(FORMAT, path, f"row {i}", "step", f"{kind(value)} is not a step number") from None
