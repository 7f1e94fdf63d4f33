"""Fill the token columns of text-only dumps (TRL completions, verl generations) by retokenising.

Invariants:
- Token ids are the `--tokenizer`'s encoding of the logged text without special tokens; that it
  is a retokenisation (not the sampled ids) is recorded in every row's `meta.import.lossy`.
- Without `--tokenizer` the import is refused naming `prompt_token_ids`; without a scoring model
  it is refused naming `gen_logprobs` (the schema requires both; see `common.score_or_refuse`).
- `finish_reason` is `stop` for every row (the text does not say whether generation was cut); this
  assumption is recorded.
"""

from __future__ import annotations

from .common import Rows, TextCodec, missing, score_or_refuse


def fill_text(rows: Rows, codec: TextCodec | None, prompts: list[str], responses: list[str],
              prompt_ids: list[list[int]] | None = None) -> None:
    """`prompt_ids`: the prompts' ids when the importer tokenises them the way its trainer does
    (TRL); else each prompt is encoded without special tokens."""
    if codec is None:
        raise missing(rows.fmt, rows.path, "prompt_token_ids", "the format holds text only; pass --tokenizer DIR")
    p_ids = prompt_ids if prompt_ids is not None else [codec.encode(p) for p in prompts]
    r_ids = [codec.encode(r) for r in responses]
    rows.note("prompt_token_ids and response_token_ids retokenised from text")
    rows.set("prompt", prompts)
    rows.set("response", responses)
    rows.set("prompt_token_ids", p_ids)
    rows.set("response_token_ids", r_ids)
    rows.set("gen_logprobs", score_or_refuse(rows, codec, p_ids, r_ids))
    rows.note("finish_reason assumed stop (a text dump does not say whether generation was cut)")
    rows.set("finish_reason", ["stop"] * len(prompts))
