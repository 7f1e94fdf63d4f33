"""Bytes per response token of a stored rollouts shard, against the same rows as JSONL.

    .venv/bin/python bench/storage_size.py [--groups 64] [--group-size 8] [--tokens 256] [--seed 0]

Rows: `rollstore.synthetic.rollouts_table(...)` (every per-token signal present). Formats:
JSONL as `rollstore import` reads it; Parquet as pyarrow writes it by default; the shard that
`Buffer.append_rollouts` commits (zstd-3, BYTE_STREAM_SPLIT float leaves); the same with
`--compact-entropies`; and the raw Arrow buffers for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pyarrow.parquet as pq  # noqa: E402

from rollstore.synthetic import rollouts_table  # noqa: E402
from storage.buffer import Buffer, token_count  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256, help="mean response tokens")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    table = rollouts_table(n_groups=args.groups, group_size=args.group_size, mean_tokens=args.tokens,
                           seed=args.seed)
    tokens = token_count(table)
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "rows.jsonl")
        with open(jsonl, "w", encoding="utf-8") as fh:
            for row in table.to_pylist():
                row["created_at"] = row["created_at"].isoformat()
                fh.write(json.dumps(row) + "\n")
        sizes["jsonl"] = os.path.getsize(jsonl)
        plain = os.path.join(tmp, "plain.parquet")
        pq.write_table(table, plain)
        sizes["parquet (pyarrow defaults: snappy, dictionary)"] = os.path.getsize(plain)
        for label, compact in (("rollstore shard", False), ("rollstore shard --compact-entropies", True)):
            with Buffer.init(os.path.join(tmp, f"buf-{compact}")) as buf:
                sizes[label] = buf.append_rollouts(table, source=jsonl, compact=compact).bytes
    sizes["arrow in memory (raw buffers)"] = table.nbytes

    print(f"rollouts_table(n_groups={args.groups}, group_size={args.group_size}, mean_tokens={args.tokens}, "
          f"seed={args.seed}): {table.num_rows} rows, {tokens} response tokens")
    width = max(map(len, sizes))
    print(f"{'format':<{width}}  {'bytes':>10}  {'bytes/token':>11}  {'vs jsonl':>8}")
    for label, n in sizes.items():
        print(f"{label:<{width}}  {n:>10}  {n / tokens:>11.2f}  {n / sizes['jsonl']:>8.3f}")


if __name__ == "__main__":
    main()
