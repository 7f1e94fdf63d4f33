"""Curated shards → padded torch batches (a trivial loader: no joins, no business logic).

A curated shard refers to its rollouts rows (schema `curated`, docs/schema.md); this module reads
the given Parquet files (a snapshot's or a lease's list) resolved by `storage.references` (the one
place that joins references to rollouts rows), checks the per-token lengths, and pads rows into
tensors.

Invariants:
- Order is deterministic: files in the order given, rows in stored order; with `shuffle_seed` a
  permutation drawn from numpy's PCG64 seeded by (seed, epoch) — the same on every machine. The
  permutation decides which rows form a step; inside a step the order does not change the step's
  loss or gradient (its denominators are the whole step's), so the learner reorders freely.
- Every row with a kept token is trained exactly once per epoch (the last step may be short);
  split across ranks (`iter_rank_steps`), every such row of a step goes to exactly one rank. A row
  with no kept token is counted in its step (the step's longest response) but, packed, never
  forwarded.
- Packed (`iter_rank_steps(pack=True)`, the learner's default), a row is trained on its prefix up to
  its last kept token (`collate(trim=True)`), and a step's rows, sorted by trained length, are cut
  into micro-batches of at most `micro_batch_size` rows whose padding is at most `PAD_SHARE` of
  their positions (`length_buckets`), so what is forwarded is the kept prefixes, little else.
  Exact for a causal model: the log-prob of a kept token depends only on the tokens before it, and
  a token after the last kept one adds nothing to the loss; `Batch.lengths` stays the full response
  length (the step's longest response, dr_grpo's normaliser, reads it).
- `input_ids` is prompt + response, right-padded with `pad_id`; response token t of row i sits at
  `input_ids[i, positions[i, t]]` with `positions[i, t] = len(prompt_i) + t`, so the logits that
  predict it are at `positions[i, t] − 1`. Every prompt has at least one token. Trimmed, a row's
  input stops before its last (kept) token: nothing reads the logits that token's own position
  would give, so it is never an input (`positions` still says where it would sit).
- Padded response positions have `response_mask` and `loss_mask` false, log-probs 0 and
  `positions` equal to the row's last real position (`positions − 1` is a valid index of the
  logits, never read by the loss).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import Tensor

from rollstore.storage.errors import RollstoreError
from rollstore.storage.references import read_curated_file
from rollstore.storage.schema import CURATED

from .losses import Normalizer
from .parallel import passes, rank_micro

TOKEN_COLUMNS = ("old_logprobs", "gen_logprobs", "loss_mask")
PAD_SHARE = 0.125  # a packed micro-batch's padding: at most this share of its positions (or one row)


@dataclass
class Batch:
    input_ids: Tensor  # [B, L] long
    attention_mask: Tensor  # [B, L] long
    positions: Tensor  # [B, T] long: index into input_ids of each response token
    response_ids: Tensor  # [B, T] long (pad_id where padded)
    response_mask: Tensor  # [B, T] bool: a real response token
    loss_mask: Tensor  # [B, T] bool: kept by curation (⊆ response_mask)
    old_logprobs: Tensor  # [B, T] float32
    gen_logprobs: Tensor  # [B, T] float32
    advantage: Tensor  # [B] float32
    weight: Tensor  # [B] float32
    lengths: Tensor  # [B] long: full response lengths (also when trimmed)
    rollout_ids: list[str]
    curation_ids: list[str]
    policy_version: Tensor | None = None  # [B] long: the version that sampled each row

    def __len__(self) -> int:
        return len(self.rollout_ids)

    @property
    def positions_run(self) -> int:
        """Positions one forward (and backward) of this batch runs: padded width × rows."""
        return int(self.input_ids.shape[0] * self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> "Batch":
        moved = {
            f.name: (getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), Tensor)
                     else getattr(self, f.name))
            for f in fields(self)
        }
        return Batch(**moved)


def read_curated(paths: Sequence[str], counts: list[int] | None = None) -> pa.Table:
    """The rows of `paths`, in order, with the `curated` columns; lengths checked per file. A thin
    shard's references are resolved against the rollouts shards of its buffer
    (`storage.references`: only the row groups holding a referenced row are read, each row's
    rollout_id checked); a reference that does not resolve is one error line."""
    tables = []
    for path in paths:
        table = read_curated_file(str(path))
        _check(table, str(path))
        tables.append(table)
        if counts is not None:
            counts.append(table.num_rows)
    if not tables:
        return CURATED.empty_table()
    return pa.concat_tables(tables)


class CuratedDataError(RollstoreError, ValueError):
    """A curated row the learner cannot train on (one line naming the file, the row and the column)."""


FINITE_COLUMNS = ("advantage", "weight", "old_logprobs", "gen_logprobs")


def check_finite(table: pa.Table, source: str) -> None:
    """Refuse (one line naming the file, the rollout and the column) a NaN or infinity in what the
    loss reads: advantage, weight and the per-token log-probs."""
    for name in FINITE_COLUMNS:
        col = table.column(name).combine_chunks()
        values = col.values if pa.types.is_list(col.type) else col
        bad = pc.invert(pc.is_finite(values)).fill_null(False)
        if not pc.any(bad).as_py():
            continue
        at = int(np.flatnonzero(np.asarray(bad.to_numpy(zero_copy_only=False)))[0])
        row = int(pc.list_parent_indices(col)[at].as_py()) if pa.types.is_list(col.type) else at
        rid = table.column("rollout_id")[row].as_py()
        raise CuratedDataError(f"{source}: row rollout_id={rid!r}: column {name!r}: {values[at].as_py()} is not a "
                               "finite number; nothing was trained: curate again without this row")


def check_vocabulary(paths: Sequence[str], vocab_size: int | None) -> None:
    """Refuse (one line naming the file, the rollout and the id) a token id at or above the model's
    vocabulary size, before anything is trained or committed; an embedding lookup would fail
    mid-training with an IndexError that says neither. Non-finite advantages, weights and log-probs
    are refused in the same pass (`check_finite`)."""
    for path in paths:
        table = read_curated_file(str(path))
        check_finite(table, str(path))
        if vocab_size is None:
            continue
        table = table.select(["rollout_id", "prompt_token_ids", "response_token_ids"])
        for name in ("prompt_token_ids", "response_token_ids"):
            col = table.column(name).combine_chunks()
            flat = pc.list_flatten(col)
            if len(flat) == 0 or pc.max(flat).as_py() < vocab_size:
                continue
            at = int(np.flatnonzero(np.asarray(pc.greater_equal(flat, vocab_size).to_numpy(zero_copy_only=False)))[0])
            row = int(pc.list_parent_indices(col)[at].as_py())
            rid = table.column("rollout_id")[row].as_py()
            raise CuratedDataError(f"{path}: row rollout_id={rid!r}: column {name!r}: token id {flat[at].as_py()} "
                                   f"is not below the model's vocabulary size {vocab_size}; train a model with a "
                                   "larger vocabulary, or curate without these rows")


def _check(table: pa.Table, source: str) -> None:
    n = pc.list_value_length(table.column("response_token_ids"))
    p = pc.list_value_length(table.column("prompt_token_ids"))
    rids = table.column("rollout_id")
    bad = pc.equal(p, 0)
    if pc.any(bad).as_py():
        rid = rids.filter(bad)[0].as_py()
        raise CuratedDataError(f"{source}: row rollout_id={rid!r}: column 'prompt_token_ids': empty prompt")
    for col in TOKEN_COLUMNS:
        bad = pc.not_equal(pc.list_value_length(table.column(col)), n)
        if pc.any(bad).as_py():
            rid = rids.filter(bad)[0].as_py()
            raise CuratedDataError(
                f"{source}: row rollout_id={rid!r}: column {col!r}: length differs from response_token_ids"
            )


def _lists(table: pa.Table, name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, offsets) of a list column."""
    col = table.column(name).combine_chunks()
    values = col.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    offsets = col.offsets.to_numpy()
    return values, offsets


def kept_extent(rows: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (kept tokens, last kept position + 1 — 0 when nothing is kept) of `loss_mask`."""
    m_vals, m_off = _lists(rows, "loss_mask", np.bool_)
    n = rows.num_rows
    kept = np.add.reduceat(m_vals.astype(np.int64), m_off[:-1]) if len(m_vals) else np.zeros(n, np.int64)
    kept = np.where(np.diff(m_off) > 0, kept, 0)  # reduceat of an empty slice reads the next value
    ends = np.zeros(n, np.int64)
    at = np.flatnonzero(m_vals)
    if len(at):
        parent = np.searchsorted(m_off, at, side="right") - 1
        np.maximum.at(ends, parent, at - m_off[parent] + 1)
    return kept, ends


def collate(rows: pa.Table, pad_id: int = 0, trim: bool = False) -> Batch:
    """Pad a table of curated rows into one Batch. With `trim`, each row's response is cut after
    its last kept token (nothing of it when none is kept): the token tensors are those of the
    prefix, `lengths` the full response lengths (see the module's invariants)."""
    b = rows.num_rows
    p_vals, p_off = _lists(rows, "prompt_token_ids", np.int64)
    r_vals, r_off = _lists(rows, "response_token_ids", np.int64)
    old_vals, old_off = _lists(rows, "old_logprobs", np.float32)
    gen_vals, gen_off = _lists(rows, "gen_logprobs", np.float32)
    m_vals, m_off = _lists(rows, "loss_mask", np.bool_)
    p_len = np.diff(p_off)
    full_len = np.diff(r_off)
    r_len = kept_extent(rows)[1] if trim else full_len
    width_t = max(1, int(r_len.max(initial=0)))
    # trimmed, the last token is not an input (what predicts it is the position before it)
    in_len = np.maximum(p_len + r_len - 1, np.maximum(p_len, 1)) if trim else p_len + r_len
    width_l = max(1, int(in_len.max(initial=0)))

    input_ids = np.full((b, width_l), pad_id, np.int64)
    attention = np.zeros((b, width_l), np.int64)
    positions = np.zeros((b, width_t), np.int64)
    response_ids = np.full((b, width_t), pad_id, np.int64)
    response_mask = np.zeros((b, width_t), np.bool_)
    loss_mask = np.zeros((b, width_t), np.bool_)
    old = np.zeros((b, width_t), np.float32)
    gen = np.zeros((b, width_t), np.float32)
    for i in range(b):
        lp, lr = int(p_len[i]), int(r_len[i])
        n_in = int(in_len[i])
        input_ids[i, :lp] = p_vals[p_off[i] : p_off[i + 1]]
        input_ids[i, lp : n_in] = r_vals[r_off[i] : r_off[i] + n_in - lp]
        attention[i, : n_in] = 1
        positions[i, :] = lp + lr - 1
        positions[i, :lr] = np.arange(lp, lp + lr)
        response_ids[i, :lr] = r_vals[r_off[i] : r_off[i] + lr]
        response_mask[i, :lr] = True
        loss_mask[i, :lr] = m_vals[m_off[i] : m_off[i] + lr]
        old[i, :lr] = old_vals[old_off[i] : old_off[i] + lr]
        gen[i, :lr] = gen_vals[gen_off[i] : gen_off[i] + lr]
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        positions=torch.from_numpy(positions),
        response_ids=torch.from_numpy(response_ids),
        response_mask=torch.from_numpy(response_mask),
        loss_mask=torch.from_numpy(loss_mask),
        old_logprobs=torch.from_numpy(old),
        gen_logprobs=torch.from_numpy(gen),
        advantage=torch.from_numpy(rows.column("advantage").to_numpy().astype(np.float32)),
        weight=torch.from_numpy(rows.column("weight").to_numpy().astype(np.float32)),
        lengths=torch.from_numpy(full_len.astype(np.int64)),
        rollout_ids=rows.column("rollout_id").to_pylist(),
        curation_ids=rows.column("curation_id").to_pylist(),
        policy_version=torch.from_numpy(rows.column("policy_version").to_numpy().astype(np.int64)),
    )


def row_order(n: int, shuffle_seed: int | None = None, epoch: int = 0) -> np.ndarray:
    if shuffle_seed is None:
        return np.arange(n)
    return np.random.Generator(np.random.PCG64([shuffle_seed, epoch])).permutation(n)


def length_buckets(rows: np.ndarray, lengths: np.ndarray, most: int, pad_share: float = PAD_SHARE) -> list[np.ndarray]:
    """`rows` (sorted by `lengths`, ascending) cut into consecutive micro-batches of at most `most`
    rows, a new one started when adding a row would make padding (width × rows − Σ lengths, the
    width being the newest row's length) more than `pad_share` of the micro-batch's positions.
    Deterministic: depends only on the lengths."""
    out, start, total = [], 0, 0
    for k in range(len(rows)):
        n, width = k - start + 1, int(lengths[k])
        if n > 1 and (n > most or n * width - (total + width) > pad_share * n * width):
            out.append(rows[start:k])
            start, total = k, 0
        total += width
    if len(rows):
        out.append(rows[start:])
    return out


@dataclass
class RankStep:
    """One global optimiser step as one rank sees it."""

    micro: list[Batch]  # this rank's micro-batches (maybe none)
    passes: int  # forward/backward passes every rank runs (>= len(micro))
    filler: Batch | None  # a real row of the step, for the zero-loss passes beyond `micro`
    curation_ids: list[str]  # sorted curations of the whole step (every rank's rows)
    norm: Normalizer  # the whole step's denominators (every rank's rows, trained or not)


def iter_rank_steps(
    rows: pa.Table,
    micro_batch_size: int,
    grad_accum: int = 1,
    pad_id: int = 0,
    shuffle_seed: int | None = None,
    epoch: int = 0,
    rank: int = 0,
    world: int = 1,
    pack: bool = True,
) -> Iterator[RankStep]:
    """Global steps of `micro_batch_size × grad_accum` rows of the loader's order. Packed (`pack`),
    a step's rows with a kept token, trimmed after their last kept token and sorted by trained
    length, form micro-batches of at most `micro_batch_size` rows of similar lengths
    (`length_buckets`); else every row of the step, whole, in the loader's order, `micro_batch_size`
    at a time (the learner before packing). Rank `rank` of `world` gets micro-batches
    `rank, rank + world, ...` (`parallel.rank_micro`). Every rank computes the same split from
    the same table; nothing depends on timing."""
    if micro_batch_size < 1 or grad_accum < 1:
        raise ValueError("micro_batch_size and grad_accum must be >= 1")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    order = row_order(rows.num_rows, shuffle_seed, epoch)
    per_step = micro_batch_size * grad_accum
    curations = rows.column("curation_id")
    kept, ends = kept_extent(rows)
    full = pc.list_value_length(rows.column("response_token_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    prompt = pc.list_value_length(rows.column("prompt_token_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    for start in range(0, len(order), per_step):
        idx = order[start : start + per_step]
        norm = Normalizer(int((kept[idx] > 0).sum()), int(kept[idx].sum()), int(full[idx].max(initial=0)))
        if pack:
            live = idx[kept[idx] > 0]
            width = prompt + ends - 1  # a trimmed row's input: up to the token before its last kept one
            live = live[np.argsort(width[live], kind="stable")]
            chunks = length_buckets(live, width[live], micro_batch_size)
        else:
            chunks = [idx[m : m + micro_batch_size] for m in range(0, len(idx), micro_batch_size)]
        micro = [collate(rows.take(pa.array(chunks[k])), pad_id, trim=pack) for k in rank_micro(len(chunks), rank, world)]
        n = passes(len(chunks), world)
        filler = collate(rows.take(pa.array(chunks[0][:1])), pad_id, trim=pack) if len(micro) < n else None
        ids = sorted(set(curations.take(pa.array(idx)).to_pylist()))
        yield RankStep(micro, n, filler, ids, norm)


def iter_steps(rows: pa.Table, *args, **kwargs) -> Iterator[list[Batch]]:
    """Optimiser steps of `micro_batch_size × grad_accum` rows, each a list of micro-batches
    (`iter_rank_steps` of a single process: same arguments)."""
    for step in iter_rank_steps(rows, *args, **kwargs):
        yield step.micro
