"""What issue 35's log-prob check and issue 37's stored response length cost, in CPU seconds of one
process (robust on a shared host, where wall times swing by several times).

On one generated buffer (`bench.common.build_buffer`, schema version 3):
- **length** — the candidates' scan of the scalar columns with the row's length taken as
  `len(entropies)` (what the code before schema version 3 ran for recipes with token selection),
  `len(response_token_ids)` (without), and the stored `response_length` (now); DuckDB at 1 thread.
- **log-probs** — `storage.references.logprob_lists` over the rows a d3s curation selects (its
  `rollouts_row` references), cold (decoding the row groups) and warm (the per-process facts), and
  the statistics-only fallback flag it replaced (`null_lists`).

    OMP_NUM_THREADS=1 python -m bench.decode_cost --tokens 10000000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from bench import common

SCAN = """
SELECT count(*), sum(t) FROM (
    SELECT rollout_id, group_id, prompt_id, run_id, policy_version, reward, correct, verify_error, finish_reason,
           ({length})::INTEGER AS t, filename, file_row_number
    FROM {rollouts} AS rollouts)
"""


def cpu(fn, repeat: int) -> float:
    """Median CPU seconds (this process, all threads) of `fn()` over `repeat` runs."""
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def measure(root: str, repeat: int) -> dict:
    import duckdb
    import numpy as np
    import pyarrow as pa

    import rollstore.storage.references as refs
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.curate.steps import parquet
    from rollstore.storage.buffer import Buffer

    with Buffer.open(root) as buf, buf.snapshot() as snap:
        files = snap.files("rollouts")
    con = duckdb.connect()
    con.execute("SET threads=1")
    rel = parquet(files, located=True, numbered=True)
    out = {"tokens": common.describe(root)["tokens"], "shards": len(files)}
    for name, length in (("len(entropies)", "len(entropies)"), ("len(response_token_ids)", "len(response_token_ids)"),
                         ("response_length (stored)", "response_length")):
        sql = SCAN.format(length=length, rollouts=rel)
        out[f"scan with {name}"] = cpu(lambda: con.execute(sql).fetchall(), repeat)

    with Buffer.open(root) as buf:
        res = curate(buf, load_recipe("d3s"), {"where": "true", "progress": "0"}, commit=False)
    cur = res.curated
    shard_files = pa.array([os.path.join(root, p) for p in cur.column("rollouts_shard").to_pylist()])
    rows = cur.column("rollouts_row").to_numpy()
    ids = cur.column("rollout_id")
    out["selected rows"] = cur.num_rows

    def cold():
        refs._facts.clear()
        refs.logprob_lists(shard_files, rows, ids)

    out["log-prob check, cold (decode)"] = cpu(cold, repeat)
    out["log-prob check, warm (per-process facts)"] = cpu(lambda: refs.logprob_lists(shard_files, rows, ids), repeat)
    out["fallback flag from statistics (before)"] = cpu(lambda: refs.null_lists(shard_files, np.asarray(rows)), repeat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--shard-tokens", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="rs-decode-cost-")
    try:
        common.build_buffer(root, a.tokens, a.shard_tokens)
        out = measure(root, a.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))
    rows = [[k, f"{v:.3f}" if isinstance(v, float) else v] for k, v in out.items()]
    print(common.md_table(["what", "CPU s (median)"], rows))


if __name__ == "__main__":
    main()
