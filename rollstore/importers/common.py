"""Shared pieces of the framework importers: deterministic ids, groups, rows, refusals.

Invariants:
- Ids are content hashes (`stable_id`): the same file (or the same logged row) imported twice
  yields the same rollout and group ids, so the second import adds nothing (`drop_present`).
- `Rows` builds a table in the rollouts schema's column order; a column it never filled is left
  absent (null where the schema allows it; `validate.conform` refuses it where it does not).
- Every lossy step an importer takes is named in `Rows.lossy` and written into each row's `meta`
  JSON (`meta.import.lossy`), so it travels with the shard and is queryable with SQL.
- A required field the format lacks is refused with one line naming the format, the file and the
  field (`missing`), before anything is written. A value of the wrong kind is refused with one line
  naming the format, the file, the line (JSONL) or row (Parquet, 0-based) and the field (`bad`);
  a file without a single row is refused as empty (`empty`). No importer lets a Python exception
  (TypeError, KeyError, ...) reach the user.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pyarrow as pa

from rollstore.storage.errors import RollstoreError, ValidationError
from rollstore.storage.schema import ROLLOUTS
from rollstore.storage.shardio import sha256_file as file_digest  # noqa: F401  (the importers' file hash)


class ImportRefused(RollstoreError):
    """An import that cannot proceed (a missing required field, an unreadable row)."""


def missing(fmt: str, path: str, name: str, hint: str = "") -> ImportRefused:
    """The one-line refusal for a field the rollouts schema requires and the format lacks."""
    extra = f"; {hint}" if hint else ""
    return ImportRefused(f"{fmt}: {path}: missing required field {name!r}{extra}")


def bad(fmt: str, path: str, where: str, name: str, problem: str) -> ImportRefused:
    """The one-line refusal for one value: `where` is "line N" (JSONL) or "row N" (Parquet)."""
    return ImportRefused(f"{fmt}: {path}: {where}: field {name!r}: {problem}")


def empty(fmt: str, path: str) -> ImportRefused:
    """The one-line refusal for a dump without a single row."""
    return ImportRefused(f"{fmt}: {path}: the file is empty (no rows to import)")


def kind(value, limit: int = 60) -> str:
    """A short description of a value for a refusal: its JSON-ish type and a clipped repr."""
    name = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{name} {text[:limit]}{'...' if len(text) > limit else ''}"


def int_list(fmt: str, path: str, where: str, name: str, value) -> list[int]:
    """`value` as a list of token ids, or a refusal naming the field."""
    if not isinstance(value, list) or not value:
        raise bad(fmt, path, where, name, f"expected a non-empty list of token ids, got {kind(value)}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad(fmt, path, where, name, f"expected non-negative integer token ids, found {kind(v)}")
    return value


def float_list(fmt: str, path: str, where: str, name: str, value, n: int) -> list:
    """`value` as a list of at least `n` numbers (nulls allowed: the writers turn NaN into null)."""
    if not isinstance(value, list) or len(value) < n:
        got = f"{len(value)} values" if isinstance(value, list) else kind(value)
        raise bad(fmt, path, where, name, f"expected a list of at least {n} numbers, got {got}")
    for v in value[:n]:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise bad(fmt, path, where, name, f"expected numbers, found {kind(v)}")
    return value


def number(fmt: str, path: str, where: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise bad(fmt, path, where, name, f"expected a number, got {kind(value)}")
    return float(value)


def stable_id(*parts) -> str:
    """A 32-hex-digit id from the JSON of `parts` (deterministic across runs and hosts)."""
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:32]


def file_time(path: str) -> dt.datetime:
    """The file's modification time (UTC): the nearest thing to a creation time these dumps have."""
    return dt.datetime.fromtimestamp(os.stat(path).st_mtime, tz=dt.timezone.utc)


def groups_by_key(keys: Sequence) -> list[int]:
    """Group index per row: rows with equal keys form one group wherever they are in the file
    (for writers that reorder rows, e.g. verl's `balance_batch`, or split them over files)."""
    order: dict = {}
    return [order.setdefault(k, len(order)) for k in keys]


def groups_from_order(keys: Sequence) -> list[int]:
    """Group index per row: consecutive rows with the same key form one group (how every one of
    these trainers lays out a generation batch: a prompt's samples are repeated next to each other)."""
    out, g, prev = [], -1, object()
    for k in keys:
        if g < 0 or k != prev:
            g += 1
            prev = k
        out.append(g)
    return out


@dataclass
class TextCodec:
    """What the text-only (and text-less) formats need from a tokenizer, and optionally a model
    that scores a response under teacher forcing (for the sampler log-probs text dumps lack)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int | None
    score: Callable[[list[int], list[int]], list[float]] | None = None
    name: str = ""
    # messages -> the prompt text the model saw (the tokenizer's chat template, generation prompt
    # added); None when the tokenizer has no chat template
    chat: Callable[[list[dict]], str] | None = None
    # how a trainer that tokenises a text prompt itself (TRL: `processing_class(text=...)`) encodes it:
    # special tokens added (e.g. BOS); and a conversation's ids from the chat template. None: `encode`
    encode_prompt: Callable[[str], list[int]] | None = None
    chat_ids: Callable[[list[dict]], list[int]] | None = None


@dataclass
class Rows:
    """Rows of one import, filled column by column, turned into one Arrow table."""

    fmt: str
    path: str
    lossy: list[str] = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=dict)
    extra_meta: list[dict] = field(default_factory=list)

    def set(self, name: str, values: list) -> None:
        self.columns[name] = values

    def identify(self, rids: list[str], gidx: list[int], prompts: list[str], run_id: str, steps: list[int]) -> None:
        """The identity columns every format fills the same way: ids, the group (`gidx`: each row's
        group index), the prompt id from the prompt's text, the sample index within the group, the
        run, and `step`, which is also the policy version (no format records another)."""
        self.set("rollout_id", rids)
        self.set("group_id", group_ids(self.fmt, gidx, rids))
        self.set("prompt_id", [stable_id("prompt", p) for p in prompts])
        self.set("sample_idx", sample_idx(gidx))
        self.set("run_id", [run_id] * len(rids))
        self.set("step", steps)
        self.set("policy_version", steps)

    def note(self, text: str) -> None:
        if text not in self.lossy:
            self.lossy.append(text)

    def table(self) -> pa.Table:
        n = len(next(iter(self.columns.values()))) if self.columns else 0
        metas = []
        for i in range(n):
            m = dict(self.extra_meta[i]) if i < len(self.extra_meta) else {}
            m["import"] = {"format": self.fmt, "file": os.path.basename(self.path), "row": i,
                           "lossy": list(self.lossy)}
            metas.append(json.dumps(m, sort_keys=True, ensure_ascii=False))
        self.columns["meta"] = metas
        arrays, fields = [], []
        for f in ROLLOUTS:
            if f.name not in self.columns:
                continue
            try:
                arrays.append(pa.array(self.columns[f.name], type=f.type))
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as exc:
                raise ValidationError(self.path, None, f.name, f"{self.fmt}: {exc}") from None
            fields.append(pa.field(f.name, f.type))
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def drop_present(table: pa.Table, existing) -> tuple[pa.Table, int]:
    """Remove rows whose rollout_id is already in the buffer (`existing` is
    `Manifest.existing_ids`); return (new rows, rows dropped). Ids are content hashes, so a row
    already imported is the same row."""
    rids = table.column("rollout_id").to_pylist()
    taken, _ = existing(rids, [])
    if not taken:
        return table, 0
    keep = [r not in taken for r in rids]
    return table.filter(pa.array(keep)), len(rids) - sum(keep)


def score_or_refuse(rows: Rows, codec: TextCodec | None, prompts: list[list[int]],
                    responses: list[list[int]]) -> list[list[float]]:
    """Sampler log-probs for text-only formats: the schema requires `gen_logprobs`, which these
    dumps do not hold. With a scoring model they are recomputed (teacher forcing; recorded as
    lossy), else the import is refused naming the field."""
    if codec is None or codec.score is None:
        raise missing(rows.fmt, rows.path, "gen_logprobs",
                      "the format holds text only; pass --score-model DIR to recompute them")
    rows.note(f"gen_logprobs recomputed by teacher forcing with {codec.name or 'the --score-model'}"
              " (not the sampler's)")
    return [codec.score(p, r) for p, r in zip(prompts, responses)]


def finish_from_eos(responses: list[list[int]], codec: TextCodec | None, rows: Rows) -> list[str]:
    """`stop` when the response ends with the tokenizer's eos token, else `length` (recorded)."""
    if codec is None or codec.eos_id is None:
        raise missing(rows.fmt, rows.path, "finish_reason", "pass --tokenizer DIR (its eos token decides it)")
    rows.note("finish_reason inferred: stop when the response ends with eos, else length")
    return ["stop" if r and r[-1] == codec.eos_id else "length" for r in responses]


def group_ids(fmt: str, gidx: list[int], rids: list[str]) -> list[str]:
    """Group id per row: a hash of the format and the group's member rollout ids."""
    members: dict[int, list[str]] = {}
    for g, r in zip(gidx, rids):
        members.setdefault(g, []).append(r)
    names = {g: stable_id(fmt, "group", ms) for g, ms in members.items()}
    return [names[g] for g in gidx]


def sample_idx(gidx: list[int]) -> list[int]:
    """Position of each row inside its group (0-based, in file order)."""
    out, count = [], {}
    for g in gidx:
        out.append(count.get(g, 0))
        count[g] = out[-1] + 1
    return out


def derive_correct(rows: Rows, threshold: float) -> None:
    """Fill the `correct` the format left null with `reward >= threshold` (recorded as lossy).
    Curation treats a row without a verdict as invalid; most trainers log rewards, not verdicts."""
    rewards = rows.columns.get("reward", [])
    given = rows.columns.get("correct") or [None] * len(rewards)
    if any(c is None for c in given):
        rows.note(f"correct derived from reward >= {threshold:g} where the format gives no verdict")
    rows.set("correct", [c if c is not None else bool(r >= threshold) for c, r in zip(given, rewards)])
