"""Storage: bytes per token, write throughput and one-column read-back, against what users dump today.

The same generated rollouts (one table per step, `common.step_table`, every per-token list
filled) are written step by step by every contender, interleaved (step k by all, then step k+1),
so that load from other processes spreads evenly over them. Each write starts from the same
in-memory Arrow table and ends with the file fsynced (rollstore also validates and commits the
shard in its manifest); converting to the format's objects is part of its cost.

Contenders:
- JSONL rows holding the token, log-prob and entropy lists (how NeMo-RL dumps training data):
  `table.to_pylist()` + `json.dumps` per row;
- `torch.save` of a trainer batch (verl's DataProto layout: int64 prompts/responses/input_ids/
  attention_mask/position_ids, float32 log-probs and entropies padded to the step's longest
  response, the other fields as Python lists);
- `torch.save` of per-sample dicts of Python lists (slime's debug rollout dump);
- `torch.save` of flat tensors (int32 ids, float32 values + offsets: the most compact torch.save);
- Parquet with pyarrow defaults (snappy, dictionary);
- the rollstore shard (`Buffer.append_rollouts`: validation, float32 + BYTE_STREAM_SPLIT, zstd 3,
  fsync, manifest commit), and the same with `--compact-entropies`.

Read-back: the `entropies` column of every step into one flat float32 array (page cache warm;
Parquet reads only that column, JSONL must parse every field with `pyarrow.json`, torch.load maps
the file with `mmap=True`, pickled lists must be unpickled whole; `weights_only=False`, the
C unpickler, the fastest). Every read-back is checked equal to the generated values (within bf16
rounding for `--compact-entropies`).

    python -m bench.storage --tokens 10_000_000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench import common

FORMATS = {
    "jsonl": "JSONL rows (token, log-prob and entropy lists; NeMo-RL style)",
    "torch_padded": "torch.save, padded batch tensors (verl DataProto layout)",
    "torch_lists": "torch.save, per-sample dicts of Python lists (slime style)",
    "torch_flat": "torch.save, flat tensors + offsets (most compact torch.save)",
    "parquet": "Parquet, pyarrow defaults (snappy, dictionary)",
    "rollstore": "**rollstore shard** (float32 + BYTE_STREAM_SPLIT, zstd 3, validated, committed)",
    "rollstore_compact": "rollstore shard, `--compact-entropies` (bf16-precision entropies)",
}
TOKEN_LISTS = ("response_token_ids", "gen_logprobs", "old_logprobs", "entropies")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _padded(col: pa.ChunkedArray | pa.Array, dtype, left: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A list column as a [B, T] array padded with 0 (left- or right-aligned) and its 0/1 mask."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    off = arr.offsets.to_numpy()
    lens = np.diff(off)
    b, t = len(lens), max(1, int(lens.max(initial=0)))
    vals = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    rows = np.repeat(np.arange(b), lens)
    pos = np.arange(len(vals)) - np.repeat(off[:-1], lens)
    if left:
        pos = pos + np.repeat(t - lens, lens)
    out = np.zeros((b, t), dtype)
    mask = np.zeros((b, t), np.int64)
    out[rows, pos] = vals
    mask[rows, pos] = 1
    return out, mask


def _scalars(table: pa.Table) -> dict:
    out = {}
    for name in table.column_names:
        if name in TOKEN_LISTS or name == "prompt_token_ids":
            continue
        col = table.column(name)
        if pa.types.is_timestamp(col.type):
            out[name] = [None if v is None else v.isoformat() for v in col.to_pylist()]
        else:
            out[name] = col.to_pylist()
    return out


def write_jsonl(table: pa.Table, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for row in table.to_pylist():
            row["created_at"] = row["created_at"].isoformat()
            fh.write(json.dumps(row) + "\n")
    _fsync(path)


def write_torch_padded(table: pa.Table, path: str) -> None:
    import torch

    prompts, p_mask = _padded(table.column("prompt_token_ids"), np.int64, left=True)
    responses, r_mask = _padded(table.column("response_token_ids"), np.int64)
    attention = np.concatenate([p_mask, r_mask], axis=1)
    batch = {
        "prompts": torch.from_numpy(prompts),
        "responses": torch.from_numpy(responses),
        "input_ids": torch.from_numpy(np.concatenate([prompts, responses], axis=1)),
        "attention_mask": torch.from_numpy(attention),
        "position_ids": torch.from_numpy(np.clip(np.cumsum(attention, axis=1) - 1, 0, None)),
        "response_mask": torch.from_numpy(r_mask),
        "rollout_log_probs": torch.from_numpy(_padded(table.column("gen_logprobs"), np.float32)[0]),
        "old_log_probs": torch.from_numpy(_padded(table.column("old_logprobs"), np.float32)[0]),
        "entropys": torch.from_numpy(_padded(table.column("entropies"), np.float32)[0]),
        "non_tensor_batch": _scalars(table),
    }
    torch.save(batch, path)
    _fsync(path)


def write_torch_lists(table: pa.Table, path: str) -> None:
    import torch

    rows = table.to_pylist()
    for row in rows:
        row["created_at"] = row["created_at"].isoformat()
    torch.save({"samples": rows}, path)
    _fsync(path)


def write_torch_flat(table: pa.Table, path: str) -> None:
    import torch

    out = {}
    for name in TOKEN_LISTS + ("prompt_token_ids",):
        arr = table.column(name).combine_chunks()
        out[name] = torch.from_numpy(arr.values.to_numpy(zero_copy_only=False).copy())
        out[name + ".offsets"] = torch.from_numpy(arr.offsets.to_numpy().copy())
    out["scalars"] = _scalars(table)
    torch.save(out, path)
    _fsync(path)


def write_parquet(table: pa.Table, path: str) -> None:
    pq.write_table(table, path)
    _fsync(path)


def read_entropies(kind: str, paths: list[str]) -> np.ndarray:
    """The `entropies` of every file, as one flat float32 array."""
    import torch

    parts = []
    for path in paths:
        if kind in ("parquet", "rollstore", "rollstore_compact"):
            col = pq.read_table(path, columns=["entropies"]).column("entropies")
            parts.append(pc.list_flatten(col).to_numpy())
        elif kind == "jsonl":
            import pyarrow.json as pj

            col = pj.read_json(path).column("entropies")
            parts.append(pc.list_flatten(col).to_numpy().astype(np.float32))
        elif kind == "torch_padded":
            d = torch.load(path, mmap=True, weights_only=False)
            parts.append(d["entropys"][d["response_mask"].bool()].numpy())
        elif kind == "torch_lists":
            d = torch.load(path, weights_only=False)
            parts.append(np.fromiter((h for s in d["samples"] for h in s["entropies"]), np.float32))
        elif kind == "torch_flat":
            d = torch.load(path, mmap=True, weights_only=False)
            parts.append(d["entropies"].numpy().copy())
        else:
            raise ValueError(kind)
    return np.concatenate(parts)


def measure(tokens: int, shard_tokens: int = 1_000_000, workdir: str | None = None, seed: int = 0,
            formats=tuple(FORMATS)) -> dict:
    import torch  # noqa: F401  (imported before any timing)

    from rollstore.storage.buffer import Buffer, token_count

    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="rs-bench-storage-")
    writers = {"jsonl": (write_jsonl, "jsonl"), "torch_padded": (write_torch_padded, "pt"),
               "torch_lists": (write_torch_lists, "pt"), "torch_flat": (write_torch_flat, "pt"),
               "parquet": (write_parquet, "parquet")}
    bufs = {}
    for kind in ("rollstore", "rollstore_compact"):
        if kind in formats:
            bufs[kind] = Buffer.init(os.path.join(workdir, kind))
    for kind in writers:
        os.makedirs(os.path.join(workdir, kind), exist_ok=True)
    files: dict[str, list[str]] = {k: [] for k in formats}
    seconds = {k: 0.0 for k in formats}
    nbytes = {k: 0 for k in formats}
    total_tokens, arrow_bytes, step, checksum = 0, 0, 0, []
    try:
        while total_tokens < tokens:
            table = common.step_table(step, shard_tokens, seed)
            total_tokens += token_count(table)
            arrow_bytes += table.nbytes
            checksum.append(pc.list_flatten(table.column("entropies")).to_numpy())
            for kind in formats:
                t0 = time.perf_counter()
                if kind in bufs:
                    shard = bufs[kind].append_rollouts(table, f"bench-step-{step}", compact=kind == "rollstore_compact")
                    seconds[kind] += time.perf_counter() - t0
                    nbytes[kind] += shard.bytes
                    files[kind].append(os.path.join(bufs[kind].root, shard.path))
                else:
                    fn, ext = writers[kind]
                    path = os.path.join(workdir, kind, f"step-{step:05d}.{ext}")
                    fn(table, path)
                    seconds[kind] += time.perf_counter() - t0
                    nbytes[kind] += os.path.getsize(path)
                    files[kind].append(path)
            step += 1
            del table
        expected = np.concatenate(checksum)
        del checksum
        read = {}
        for kind in formats:
            t0 = time.perf_counter()
            got = read_entropies(kind, files[kind])
            read[kind] = time.perf_counter() - t0
            if kind == "rollstore_compact":
                ok = bool(np.all(np.abs(got - expected) <= np.abs(expected) * 2.0**-8))  # bf16 rounding
            else:
                ok = np.array_equal(got, expected)
            if not ok:
                raise AssertionError(f"{kind}: entropies read back differ from the generated values")
            del got
    finally:
        for b in bufs.values():
            b.close()
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"tokens": total_tokens, "rows": step * common.groups_per_shard(shard_tokens) * common.GROUP_SIZE,
            "steps": step, "seconds": seconds, "bytes": nbytes, "read": read, "arrow_bytes": arrow_bytes}


def ratios(m: dict) -> dict:
    b = m["bytes"]
    return {"size_vs_jsonl": b["rollstore"] / b["jsonl"], "size_vs_torch_padded": b["rollstore"] / b["torch_padded"],
            "size_vs_parquet": b["rollstore"] / b["parquet"],
            "compact_vs_jsonl": b.get("rollstore_compact", b["rollstore"]) / b["jsonl"]}


def tables(m: dict) -> str:
    t, b, s, r = m["tokens"], m["bytes"], m["seconds"], m["read"]
    rows = []
    for kind in m["bytes"]:
        rows.append([FORMATS[kind], b[kind] / 2**20, b[kind] / t, b[kind] / b["jsonl"], b[kind] / b["rollstore"],
                     s[kind], t / s[kind] / 1e6, s[kind] / s["rollstore"], r[kind], r[kind] / r["rollstore"]])
    rows.append(["Arrow in memory (raw buffers, for reference)", m["arrow_bytes"] / 2**20, m["arrow_bytes"] / t,
                 m["arrow_bytes"] / b["jsonl"], m["arrow_bytes"] / b["rollstore"], None, None, None, None, None])
    return common.md_table(["format", "MiB", "bytes/token", "size / JSONL", "size / rollstore", "write s",
                            "write Mtokens/s", "write time / rollstore", "read 1 column s", "read / rollstore"], rows)


def section(m: dict, command: str | None = None, level: int = 3) -> str:
    extra = [f"Rows: {m['steps']} steps of `rollouts_table(mean_tokens={common.MEAN_TOKENS}, "
             f"group_size={common.GROUP_SIZE})`, {m['rows']:,} rollouts, {m['tokens']:,} response tokens, every "
             "per-token list filled (token ids, sampler and trainer log-probs, entropies); one file per step per "
             "format, written interleaved; write = from the Arrow table in memory to an fsynced file; read = "
             "`entropies` of all files into one float32 array, page cache warm, checked equal to the source"]
    return (common.header("Storage: size, write throughput, one-column read-back", command, extra, level,
                          libs=("pyarrow", "torch", "numpy")) + "\n\n" + common.method(__doc__) + "\n\n" + tables(m) + "\n\n"
            "Synthetic log-probs and entropies are random floats, so they compress less than real ones would; "
            "the ratios are the numbers to carry over.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--shard-tokens", type=int, default=1_000_000)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    m = measure(a.tokens, a.shard_tokens, a.workdir)
    common.publish(section(m), record=not a.no_record)


if __name__ == "__main__":
    main()
