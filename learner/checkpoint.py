"""Exactly-once learner checkpoints in a buffer: `BUFFER/checkpoints/v<version>/` + one manifest row.

A checkpoint directory holds the weights (`save_pretrained`, safetensors), the tokenizer files
when a tokenizer is given, `trainer_state.pt` (optimizer, scheduler, RNG states, global step) and
`ledger.json` (version, parent, run, the curated shards trained into this version). It is
published as one row of the `checkpoints` table, whose `consumed` column is the JSON list
`[{"curation_id": ..., "shard": <path relative to the buffer>}, ...]` of the shards trained
*into this version* (since its parent); the ledger of a version is the concatenation of
`consumed` along its parent chain.

Invariants:
- Nothing half-written is ever visible: files are written and fsynced under `tmp/`, and the
  directory is renamed to `checkpoints/v<version>/` inside the manifest write transaction that
  inserts the row (the row's insert is the commit point). A crash before the commit leaves an
  orphan directory with no row; the next save of that version moves it away under the same lock.
- Within that transaction the save is refused (and nothing is published) if the version already
  has a row, or if a shard it consumes was already consumed by another checkpoint of the same run:
  no version is published twice and no shard is trained twice into one run, whatever the callers
  do (a stale resume, two learners of one run).
- Training metrics rows passed to `save_checkpoint` (`Publish.training_rows`) are committed in the same transaction, so the
  `training` table holds each step of a published version exactly once.
- When leases are used (`Publish.lease=(consumer, group)`), the consumed shards' leases are acked in the
  same transaction; a lease lost to another consumer refuses the save. On a buffer cataloged in
  PostgreSQL the consumed ledger is also a catalog table (`consumed`, checked and written in that
  transaction), and a lease that expired on the database's clock refuses the save even when
  nobody took it over (a learner stalled past its TTL is refused at publish).
- The publishing transaction also writes the version's row into the catalog's checkpoint index
  (`storage.catalog_sql.CHECKPOINT_DDL`), and first indexes any checkpoints shard that has none (a
  buffer written before the index): listing, the newest version of a run, a version, its ledger and
  the checks above are catalog queries, not a read of every checkpoint file. A shard without an
  index row is read from its file until then, so a reader never misses a published version.
- With `Publish.retention` the same transaction prunes the run's versions `learner.retention` does
  not keep (their rows stay); their folders are removed after the commit.
- `load_checkpoint` restores weights bit-exactly (float32 safetensors) and the exact optimizer,
  scheduler and RNG states, so a resumed run continues as if never interrupted.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import random
import shutil
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rollstore.storage.shardio import fsync_dir, sha256_file
from rollstore.storage.buffer import Buffer, Part
from rollstore.storage.catalog import holding
from rollstore.storage.errors import RollstoreError
from rollstore.storage.catalog_sql import CHECKPOINT_COLS
from rollstore.storage.owners import owned_name
from rollstore.storage.schema import CHECKPOINTS, TRAINING

TRAINER_STATE = "trainer_state.pt"
LEDGER = "ledger.json"


class CheckpointError(RollstoreError):
    """A checkpoint could not be published or loaded; nothing was published."""


@dataclass(frozen=True)
class Checkpoint:
    version: int
    path: str  # relative to the buffer: checkpoints/v<version>
    run_id: str
    parent_version: int | None
    consumed: list[dict]  # this version's shards: [{"curation_id": ..., "shard": ...}]
    metrics: dict
    created_at: dt.datetime | None = None
    root: str = ""  # the buffer's root
    step: int = 0  # global optimiser step (filled by load_checkpoint)
    ledger: list[dict] = field(default_factory=list)  # whole lineage's consumed (by load_checkpoint)
    _local: Callable[[], str] | None = field(default=None, repr=False, compare=False)  # a store's: fetch it
    pruned_seq: int | None = None  # the commit that gave its files up (`learner.retention`); None: kept
    tag: str | None = None  # a user's name for it (its files are kept)

    @property
    def dir(self) -> str:
        """The folder on this host (a store's buffer: fetched into its cache, verified, on first use)."""
        return self._local() if self._local is not None else os.path.join(self.root, self.path)


def consumed_entry(curation_id: str, shard: str) -> dict:
    return {"curation_id": curation_id, "shard": shard}


# ---- reading --------------------------------------------------------------------------------


def _rows_from_files(files: Iterable[str]) -> list[dict]:
    rows: list[dict] = []
    for f in files:
        st = os.stat(f)
        rows.extend(dict(r) for r in _rows_of_file(f, st.st_size, st.st_mtime_ns, st.st_ino))
    return rows


@functools.lru_cache(maxsize=4096)
def _rows_of_file(path: str, size: int, mtime_ns: int, inode: int) -> tuple[dict, ...]:
    """A checkpoints shard's rows. Shards are immutable once published, so a loop that lists the
    checkpoints every iteration reads each file once (keyed by its identity, not only its path)."""
    return tuple(pq.read_table(path, columns=CHECKPOINTS.names).to_pylist())


def _to_checkpoint(row: dict, root: str, buf: Buffer | None = None) -> Checkpoint:
    local = None
    if buf is not None and buf.manifest.store is not None:
        local = functools.partial(_fetch_dir, buf, row["path"])
    return Checkpoint(
        version=int(row["version"]),
        path=row["path"],
        run_id=row["run_id"],
        parent_version=None if row["parent_version"] is None else int(row["parent_version"]),
        consumed=json.loads(row["consumed"]),
        metrics=json.loads(row["metrics"]),
        created_at=row["created_at"],
        root=root,
        _local=local,
        pruned_seq=row.get("pruned_seq"),
        tag=row.get("tag"),
    )


def _from_index(r: tuple) -> dict:
    """A checkpoints row (plus `shard_id`, `pruned_seq`, `tag`) from its index row (CHECKPOINT_COLS)."""
    row = dict(zip(CHECKPOINT_COLS, r))
    row["created_at"] = _EPOCH + dt.timedelta(microseconds=int(row.pop("created_us")))
    return row


def _index_values(shard_id: int, row: dict) -> tuple:
    """The index row (CHECKPOINT_COLS but pruned_seq and tag) of a checkpoints row."""
    created = row["created_at"]
    created_us = (created - _EPOCH) // dt.timedelta(microseconds=1)
    return (int(shard_id), int(row["version"]), row["run_id"], row["parent_version"], row["path"], created_us,
            row["consumed"], row["metrics"])


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def _unindexed_rows(buf: Buffer, missing: list[tuple[int, str]]) -> list[dict]:
    """The rows of checkpoints shards the index does not hold (a buffer written before it), read from
    their files (a store's buffer: through this host's verified cache), each with its `shard_id`."""
    if buf.manifest.store is not None:
        from rollstore.storage.store import cache_shards

        cache_shards(buf.root, buf.manifest, buf.manifest.shards_by_id([i for i, _ in missing]))
    rows = []
    for shard_id, path in missing:
        rows += [{**r, "shard_id": shard_id} for r in _rows_from_files([os.path.join(buf.root, path)])]
    return rows


def checkpoint_rows(buf: Buffer, run_id: str | None = None, version: int | None = None, newest: int = 0,
                    con=None, exclude: Sequence[int] = (), unpruned: bool = False) -> list[dict]:
    """The live checkpoints rows (of `run_id`, of `version`; `newest` > 0: the highest `newest`
    versions alone; `unpruned`: those whose files retention kept), by version, answered by the
    catalog's checkpoint index (`storage.catalog_sql.CHECKPOINT_DDL`): no checkpoint file is read, but
    those of shards published before the index existed. `con`: inside that transaction; `exclude`:
    shard ids left out (the commit in progress)."""
    n = int(newest) + len(exclude) if newest else 0  # (the excluded ones may be among the highest)
    indexed, missing = buf.manifest.checkpoint_index(None, run_id, version, n, con, unpruned)
    rows = sorted((r for r in map(_from_index, indexed) if r["shard_id"] not in exclude), key=lambda r: int(r["version"]))
    missing = [(i, p) for i, p in missing if i not in exclude]
    if missing:
        rows += [r for r in _unindexed_rows(buf, missing)
                 if (run_id is None or r["run_id"] == run_id) and (version is None or int(r["version"]) == version)]
        rows.sort(key=lambda r: int(r["version"]))
    return rows[-int(newest):] if newest else rows


def list_checkpoints(buf: Buffer, run_id: str | None = None) -> list[Checkpoint]:
    """Published checkpoints (latest snapshot), by version."""
    return [_to_checkpoint(r, buf.root, buf) for r in checkpoint_rows(buf, run_id)]


def latest_checkpoint(buf: Buffer, run_id: str | None = None) -> Checkpoint | None:
    """The highest published version (of `run_id`): one index query."""
    rows = checkpoint_rows(buf, run_id, newest=True)
    return _to_checkpoint(rows[0], buf.root, buf) if rows else None


def get_checkpoint(buf: Buffer, version: int) -> Checkpoint | None:
    """Published checkpoint `version`, or None: one index query."""
    rows = checkpoint_rows(buf, version=version)
    return _to_checkpoint(rows[-1], buf.root, buf) if rows else None


def consumed_in_lineage(buf: Buffer, version: int, shards: Sequence[str]) -> set[str]:
    """Which of `shards` were trained into `version` along its parent chain: the ledger table looked
    up by shard, then, for each version that consumed one, whether it is `version` or an ancestor
    (a walk up the parent chain from `version` to it, by the index: versions only decrease along
    it). A loop's pending shards are new ones, consumed by no version: no history is read."""
    if not shards:
        return set()
    if not buf.manifest.has_table("checkpoint_index") or buf.manifest.unindexed_checkpoints():
        return {e["shard"] for e in consumed_ledger(buf, version)} & set(shards)  # not all indexed yet
    hits = buf.manifest.consumed_by(list(shards))
    if not hits:
        return set()
    lineage: set[int] = set()
    v: int | None = version
    lowest = min(h for _s, h in hits)
    while v is not None and v >= lowest:
        row = checkpoint_rows(buf, version=v)
        if not row:
            break
        lineage.add(v)
        v = row[-1]["parent_version"]
    return {s for s, h in hits if h in lineage}


def consumed_ledger(buf: Buffer, version: int | None) -> list[dict]:
    """Every shard trained into `version` along its parent chain, oldest first (None: [])."""
    if version is None:
        return []
    by_version = {int(r["version"]): r for r in checkpoint_rows(buf)}
    chain: list[dict] = []
    v: int | None = version
    while v is not None:
        if v not in by_version:
            if chain:  # the root of the lineage (e.g. v0, the base model) need not be published
                break
            raise CheckpointError(f"{buf.root}: no checkpoint version {v}")
        chain.append(by_version[v])
        parent = by_version[v]["parent_version"]
        v = None if parent is None else int(parent)
    return [e for r in reversed(chain) for e in json.loads(r["consumed"])]


# ---- writing --------------------------------------------------------------------------------


def _fsync_tree(path: str) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fsync_dir(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_dir(
    tmp: str, model, tokenizer, optimizer, scheduler, step: int, ledger: dict
) -> None:
    os.makedirs(tmp)
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar on stderr per checkpoint
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(
        {
            "optimizer": None if optimizer is None else optimizer.state_dict(),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "rng": _rng_state(),
            "step": int(step),
        },
        os.path.join(tmp, TRAINER_STATE),
    )
    with open(os.path.join(tmp, LEDGER), "w", encoding="utf-8") as fh:
        json.dump(ledger, fh, indent=1, sort_keys=True)
    _fsync_tree(tmp)
    fsync_dir(os.path.dirname(tmp))


def index_missing(buf: Buffer, con, seq: int, new: Sequence[dict] = ()) -> None:
    """Inside the transaction `con` (commit `seq`): index, with their ledger, the live checkpoints
    shards that have no index row yet (a buffer written before the index, or by a rollstore without
    it: read from their files once) and the rows `new` (each with its `shard_id`); then record that
    every live checkpoints shard committed so far is indexed (`indexed_through`)."""
    man = buf.manifest
    man.index_checkpoints(con, [])  # the tables, on first use
    skip = {int(r["shard_id"]) for r in new}
    old = [(i, p) for i, p in man.unindexed_checkpoints(con=con) if i not in skip]
    found = (_unindexed_rows(buf, old) if old else []) + list(new)
    man.index_checkpoints(con, [_index_values(r["shard_id"], r) for r in found])
    man.record_ledger(con, seq, [(r["shard_id"], r["version"], r["run_id"], json.loads(r["consumed"])) for r in found])
    man.indexed_through(con)  # every shard committed so far


@dataclass(frozen=True)
class Publish:
    """What checkpoint `version` publishes beside its files: its run and parent version, the shards
    trained into it since the parent (`consumed`: `consumed_entry(curation_id, shard)` with `shard`
    relative to the buffer), the global optimiser step reached, its metrics, the `training` rows of
    its steps and the lease to ack (`(consumer, group)`), all in one manifest commit."""

    version: int
    run_id: str
    consumed: Sequence[dict]
    parent_version: int | None = None
    step: int = 0
    metrics: dict | None = None
    training_rows: Sequence[dict] | None = None
    lease: tuple[str, str] | None = None
    retention: tuple[int, int] | None = None  # (K, replay window): prune the run's older versions (`learner.retention`)


def save_checkpoint(
    buf: Buffer,
    model,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    *,
    publish: Publish,
    tokenizer=None,
) -> Checkpoint:
    """Write and publish checkpoint `publish.version` (see the module invariants); return it."""
    store = buf.manifest.store  # object storage (storage/store.py): no rename there
    p = replace(publish, version=int(publish.version), metrics=publish.metrics or {},
                consumed=[consumed_entry(e["curation_id"], e["shard"]) for e in publish.consumed])
    version, run_id = p.version, p.run_id
    if p.parent_version is not None and p.parent_version >= version:
        raise CheckpointError(f"checkpoint v{version}: parent version {p.parent_version} is not older")
    shards = [e["shard"] for e in p.consumed]
    if len(set(shards)) != len(shards):
        raise CheckpointError(f"checkpoint v{version}: a shard is listed twice in consumed")
    # In object storage each attempt writes its own keys (put-if-absent, never renamed); the row names them.
    rel = f"checkpoints/v{version}" if store is None else f"checkpoints/v{version}-{uuid.uuid4().hex[:12]}"
    final = os.path.join(buf.root, rel)
    tmp = os.path.join(buf.root, "tmp", owned_name("ckpt"))  # gc keeps it while we live
    ledger = {"version": version, "parent_version": p.parent_version, "run_id": run_id, "consumed": p.consumed}
    now = dt.datetime.now(dt.timezone.utc)
    parts = _parts(p, rel, now)
    moved_aside: list[str] = []
    objects: list[tuple[str, str, int]] = []  # (key, sha256, bytes) uploaded to the store

    def publish_in(con, _seq: int, ids: list[int]) -> None:
        # Runs inside the manifest write transaction: every check and the rename are serialised
        # against every other writer of this buffer.
        index_missing(buf, con, _seq, [{**parts[0].table.to_pylist()[0], "shard_id": ids[0]}])
        why = buf.manifest.record_consumed(con, run_id, version, p.consumed, ids[0], _seq)  # the ledger's checks
        if why is not None:
            raise CheckpointError(f"{buf.root}: {why}")
        if p.retention is not None:  # in the same commit: the new version counts among the newest K
            from .retention import prune_in

            prune_in(buf, con, _seq, p.retention[0], p.retention[1], run_id)
        if p.lease is not None:
            _ack_in_transaction(buf, con, shards, *p.lease, now.timestamp())
        if store is not None:  # the objects were uploaded before; this row names them (the commit point)
            buf.manifest.record_objects(con, _seq, objects)
            return
        if os.path.lexists(final):  # an orphan of a crashed save: no row names it (checked above)
            aside = os.path.join(buf.root, "tmp", owned_name("orphan"))
            os.rename(final, aside)
            moved_aside.append(aside)
        os.rename(tmp, final)
        fsync_dir(os.path.dirname(final))

    with holding(buf.manifest, os.path.relpath(tmp, buf.root)):  # a catalog's intent on the folder
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            _write_dir(tmp, model, tokenizer, optimizer, scheduler, p.step, ledger)
            if store is not None:
                objects += _upload_dir(buf, store, tmp, rel)
            buf.commit(parts, f"checkpoint:v{version}", {"version": version, "run_id": run_id}, publish_in)
            if store is not None:  # this host's cached copy: the bytes it hashed and uploaded
                os.rename(tmp, final)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            for d in moved_aside:
                shutil.rmtree(d, ignore_errors=True)
    if p.retention is not None:  # the files of the versions pruned (now or before), unless a pinned snapshot is older
        from rollstore.storage.maintenance import collect_pruned

        collect_pruned(buf)
    return Checkpoint(version, rel, run_id, p.parent_version, p.consumed, p.metrics, now, buf.root, int(p.step))


def _upload_dir(buf: Buffer, store, tmp: str, rel: str) -> list[tuple[str, str, int]]:
    """Put every file of the folder `tmp` into the store under `rel/` (put-if-absent), each after an
    intent on its key (the commit that names them fences them; gc of any host leaves them alone
    meanwhile); return (key, sha256, bytes) of each, hashed here from the bytes uploaded."""
    files = sorted(os.path.relpath(os.path.join(d, n), tmp) for d, _dirs, names in os.walk(tmp) for n in names)
    keys = [f"{rel}/{f}" for f in files]
    buf.manifest.intend(keys)
    out = []
    for f, key in zip(files, keys):
        local = os.path.join(tmp, f)
        store.put_if_absent(key, local)
        out.append((key, sha256_file(local), os.path.getsize(local)))
    return out


def _fetch_dir(buf: Buffer, rel: str) -> str:
    """The local folder of checkpoint folder `rel` of a store's buffer, every file in this host's
    cache and verified against the catalog's sha256 as it downloaded."""
    man = buf.manifest
    objects = man.objects_under(rel + "/")
    if not objects:
        raise CheckpointError(f"{buf.root}: checkpoint {rel} has no files in the catalog")
    for key, digest, nbytes in objects:
        man.store.fetch(buf.root, key, digest, nbytes, man.holding)
    return os.path.join(buf.root, rel)


def _parts(p: Publish, rel: str, now: dt.datetime) -> list[Part]:
    """The manifest parts of one checkpoint: its `checkpoints` row and its `training` rows."""
    row = {
        "version": p.version,
        "created_at": now,
        "path": rel,
        "run_id": p.run_id,
        "parent_version": p.parent_version,
        "consumed": json.dumps(p.consumed),
        "metrics": json.dumps(p.metrics, sort_keys=True),
    }
    parts = [Part("checkpoints", pa.Table.from_pylist([row], schema=CHECKPOINTS), key=str(p.version))]
    if p.training_rows:
        parts.append(Part("training", pa.Table.from_pylist(list(p.training_rows), schema=TRAINING)))
    return parts


def _ack_in_transaction(buf: Buffer, con, shards: list[str], consumer: str, group: str,
                        now: float) -> None:
    missing = buf.manifest.ack_paths(con, shards, consumer, group, now)
    if missing:
        raise CheckpointError(f"lease on {missing[0]} is not held by {consumer!r} (group {group!r}); nothing published")


def append_training_metrics(buf: Buffer, rows: Sequence[dict]):
    """Append `training` rows (e.g. steps of a run that publishes no checkpoint) as one shard."""
    return buf.append("training", pa.Table.from_pylist(list(rows), schema=TRAINING))


# ---- loading --------------------------------------------------------------------------------


def _load_weights(model, directory: str) -> None:
    from safetensors.torch import load_file

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(directory, name)))
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise CheckpointError(f"{directory}: weights not in the model: {result.unexpected_keys[:3]}")
    if result.missing_keys:  # only tied weights may be absent from the file
        own = model.state_dict()
        loaded_ptrs = {own[k].data_ptr() for k in state if k in own}
        untied = [k for k in result.missing_keys if own[k].data_ptr() not in loaded_ptrs]
        if untied:
            raise CheckpointError(f"{directory}: weights missing from the checkpoint: {untied[:3]}")


def load_checkpoint(
    buf: Buffer,
    model=None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    *,
    version: int | None = None,
    run_id: str | None = None,
    restore_rng: bool = True,
) -> Checkpoint:
    """Restore checkpoint `version` (default: the latest, of `run_id` if given) into the objects
    given; return it with `step` and the lineage's `ledger` filled. `model=None` loads no weights
    (use `Checkpoint.dir` with `from_pretrained`)."""
    if version is None:
        ck = latest_checkpoint(buf, run_id)
        if ck is None:
            raise CheckpointError(f"{buf.root}: no checkpoint" + (f" of run {run_id!r}" if run_id else ""))
    else:
        ck = get_checkpoint(buf, version)
        if ck is None:
            raise CheckpointError(f"{buf.root}: no checkpoint version {version}")
    if ck.pruned_seq is not None:
        raise CheckpointError(f"{buf.root}: checkpoint v{ck.version}'s files were pruned (keep-checkpoints, commit "
                              f"{ck.pruned_seq}); its row (lineage, ledger) remains; load a newer version")
    directory = ck.dir  # (a store's buffer: fetched and verified now)
    with open(os.path.join(directory, LEDGER), encoding="utf-8") as fh:
        ledger = json.load(fh)
    if ledger["version"] != ck.version or ledger["consumed"] != ck.consumed:
        raise CheckpointError(f"{directory}: ledger.json does not match the manifest row of v{ck.version}")
    if model is not None:
        _load_weights(model, directory)
    state = torch.load(os.path.join(directory, TRAINER_STATE), map_location="cpu", weights_only=True)
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        _set_rng_state(state["rng"])
    return Checkpoint(
        ck.version, ck.path, ck.run_id, ck.parent_version, ck.consumed, ck.metrics, ck.created_at,
        ck.root, int(state["step"]), consumed_ledger(buf, ck.version), ck._local,
    )
