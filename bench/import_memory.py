"""Peak memory of `rollstore import` of one big JSONL file (issue 24: imports stream in bounded memory).

    python -m bench.import_memory --rows 1000000 [--mean-tokens 8] [--dir /tmp/import-memory]

Writes N one-row groups as JSONL (synthetic rows, `rollstore.builtin.synthetic`), then runs the real
`rollstore import BUFFER FILE` in a child process and prints its wall time and peak resident
memory (the child's ru_maxrss), with the file's size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

from rollstore.builtin.synthetic import RowOptions, rollouts_table


def write_rows(path: str, rows: int, mean_tokens: int, chunk: int = 50_000) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            table = rollouts_table(n_groups=n, group_size=1, mean_tokens=mean_tokens, seed=start,
                                   options=RowOptions(id_prefix=f"c{start}"))
            for row in table.to_pylist():
                row["created_at"] = row["created_at"].isoformat()
                fh.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--mean-tokens", type=int, default=8)
    ap.add_argument("--dir", default="/tmp/import-memory")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    path = os.path.join(args.dir, "rows.jsonl")
    t0 = time.perf_counter()
    write_rows(path, args.rows, args.mean_tokens)
    print(f"wrote {args.rows} rows ({os.path.getsize(path) / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s",
          flush=True)
    exe = os.path.join(os.path.dirname(sys.executable), "rollstore")
    buf = os.path.join(args.dir, "buf")
    subprocess.run([exe, "init", buf], check=True, capture_output=True)
    t0 = time.perf_counter()
    res = subprocess.run([exe, "import", buf, path], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(res.stdout.strip() or res.stderr.strip())
    print(f"import: exit {res.returncode}, {wall:.1f} s, peak RSS {peak / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
