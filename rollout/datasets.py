"""Prompt datasets from JSONL or Parquet files.

A row needs a prompt field (`prompt`, `problem` or `question`, first found wins) and an answer field
(`answer`, then `solution`). The gold answer is reduced to what a verifier compares: GSM8K's
`... #### 42` gives `42`, a MATH solution gives the content of its last `\\boxed{...}` (nested braces
and escaped `\\{`/`\\}` handled), anything else is the stripped answer text.

Invariants:
- Every returned `Prompt` has a non-empty prompt and gold answer; `prompt_id` comes from the row's
  `prompt_id` or `id` field, else `prompt_hash` of the raw prompt text (before the template), so the
  same question keeps its id across files, templates and runs.
- `prompt` is the text given to the model: the chat template (a format string with `{prompt}`)
  applied to the raw prompt, or the raw prompt when there is no template.
- A bad row raises `DatasetError` with one line naming the file and the line (JSONL, 1-based, blank
  lines counted) or row (Parquet, 1-based); nothing is returned for a file with any bad row.
- One id never names two different prompts within a file.
"""

from __future__ import annotations

import json
import os
import re

from rollstore.storage.errors import RollstoreError

from .prompt_sources import Prompt, prompt_hash

PROMPT_FIELDS = ("prompt", "problem", "question")
ANSWER_FIELDS = ("answer", "solution")
ID_FIELDS = ("prompt_id", "id")
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


class DatasetError(RollstoreError):
    """A dataset file or row is unusable; str() is one line naming the file and line."""

    def __init__(self, file: str, where: str | None, message: str):
        self.file, self.where, self.message = file, where, message
        super().__init__(f"{file}: {where}: {message}" if where else f"{file}: {message}")


# ---------------------------------------------------------------- answer reduction


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in text; None if absent
    or unbalanced."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if i < len(text) and text[i] == " ":  # `\boxed 5`: one token, up to whitespace or `$`
        m = re.match(r" +([^\s$]+)", text[i:])
        return m.group(1) if m else None
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch == "\\":  # escaped character (`\{`, `\}`, `\\`): never a delimiter
            j += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
        j += 1
    return None


def gsm8k_answer(text: str) -> str | None:
    """The final answer after GSM8K's last `####`, thousands separators removed; None if absent."""
    if "####" not in text:
        return None
    ans = text.rsplit("####", 1)[1].strip()
    if _THOUSANDS.match(ans):
        ans = ans.replace(",", "")
    return ans or None


def reduce_answer(field: str, value) -> str:
    """Gold answer of an `answer` or `solution` field value; raises ValueError if none."""
    if value is None:
        raise ValueError(f"field {field!r} is null")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"field {field!r} must be text or a number, got {type(value).__name__}")
    if not isinstance(value, str):
        return str(value)
    text = value.strip()
    if not text:
        raise ValueError(f"field {field!r} is empty")
    if "####" in text:
        ans = gsm8k_answer(text)
        if ans is None:
            raise ValueError(f"field {field!r} has nothing after '####'")
        return ans
    if any(cmd in text for cmd in _BOX_COMMANDS):
        ans = last_boxed(text)
        if not ans:
            raise ValueError(f"field {field!r} has an empty or unbalanced \\boxed{{...}}")
        return ans
    if field == "solution":
        raise ValueError("field 'solution' has no \\boxed{...} and no '####' answer")
    return text


def apply_template(template: str | None, text: str) -> str:
    """The prompt as given to the model: `template.format(prompt=text)`, or text itself."""
    if template is None:
        return text
    return template.format(prompt=text)


def check_template(template: str | None) -> None:
    if template is None:
        return
    if "{prompt}" not in template:
        raise ValueError("chat template must contain '{prompt}'")
    try:
        template.format(prompt="x")
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"chat template is not a valid format string ({exc}); write literal braces as '{{{{' and '}}}}'") from None


# ---------------------------------------------------------------- rows


def _row_prompt(row: dict, template: str | None, source: str) -> Prompt:
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    field = next((f for f in PROMPT_FIELDS if row.get(f) is not None), None)
    if field is None:
        raise ValueError(f"no prompt field (one of {', '.join(PROMPT_FIELDS)})")
    raw = row[field]
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"field {field!r} must be non-empty text")
    ans_field = next((f for f in ANSWER_FIELDS if f in row and row[f] is not None), None)
    if ans_field is None:
        raise ValueError(f"no answer field (one of {', '.join(ANSWER_FIELDS)})")
    gold = reduce_answer(ans_field, row[ans_field])
    pid = None
    for f in ID_FIELDS:
        if row.get(f) is not None:
            pid = str(row[f]).strip()
            if not pid:
                raise ValueError(f"field {f!r} is empty")
            break
    difficulty = row.get("difficulty")
    if difficulty is not None and (isinstance(difficulty, bool) or not isinstance(difficulty, int)):
        difficulty = None  # free-text levels ("Level 3") are not ours to interpret
    return Prompt(
        prompt_id=pid or prompt_hash(raw),
        prompt=apply_template(template, raw),
        gold_answer=gold,
        source=source,
        difficulty=difficulty,
        meta={"raw_prompt": raw} if template is not None else {},
    )


def _jsonl_rows(path: str):
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield f"line {lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(path, f"line {lineno}", f"invalid JSON ({exc.msg})") from None


def _parquet_rows(path: str):
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - any reader failure is a bad file
        raise DatasetError(path, None, f"not a readable Parquet file ({str(exc).splitlines()[0]})") from None
    names = set(pf.schema_arrow.names)
    wanted = [c for c in PROMPT_FIELDS + ANSWER_FIELDS + ID_FIELDS + ("difficulty",) if c in names]
    rowno = 0
    for batch in pf.iter_batches(batch_size=4096, columns=wanted or None):
        for row in batch.to_pylist():
            rowno += 1
            yield f"row {rowno}", row


def load_prompts(
    path: str, template: str | None = None, source: str | None = None, limit: int | None = None
) -> list[Prompt]:
    """All prompts of a .jsonl/.ndjson or .parquet file (the first `limit` rows if given)."""
    if not os.path.isfile(path):
        raise DatasetError(path, None, "no such file")
    try:
        check_template(template)
    except ValueError as exc:
        raise DatasetError(path, None, str(exc)) from None
    lower = path.lower()
    if lower.endswith((".jsonl", ".ndjson")):
        rows = _jsonl_rows(path)
    elif lower.endswith((".parquet", ".pq")):
        rows = _parquet_rows(path)
    else:
        raise DatasetError(path, None, "unknown dataset format (expected .jsonl or .parquet)")
    source = source or os.path.basename(path)
    out: list[Prompt] = []
    texts: dict[str, tuple[str, str]] = {}  # prompt_id -> (prompt text, where first seen)
    for where, row in rows:
        try:
            prompt = _row_prompt(row, template, source)
        except ValueError as exc:
            raise DatasetError(path, where, str(exc)) from None
        seen = texts.get(prompt.prompt_id)
        if seen is not None and seen[0] != prompt.prompt:
            raise DatasetError(
                path, where, f"prompt_id {prompt.prompt_id!r} names a different prompt than at {seen[1]}"
            )
        texts.setdefault(prompt.prompt_id, (prompt.prompt, where))
        out.append(prompt)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DatasetError(path, None, "no prompts in file")
    return out
