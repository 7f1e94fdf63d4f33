"""Simulated hosts for the tests of a buffer cataloged in PostgreSQL, and the invariant checker run
after every trial.

A simulated host is a process with its own host id (`ROLLSTORE_HOST_ID`), its own catalog
connection, appending to one buffer folder; `appender_script` is what it runs.
"""

from __future__ import annotations

import hashlib
import os

import pyarrow.parquet as pq

from rollstore.storage.buffer import Buffer

APPENDER = """
import os, sys, time
sys.path.insert(0, {root!r})
os.environ.setdefault("OMP_NUM_THREADS", "1")
from rollstore.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer
host = os.environ["ROLLSTORE_HOST_ID"]
buf = Buffer.open({buffer!r})
lat = []
for step in range({n}):
    table = rollouts_table(n_groups=1, group_size={group}, mean_tokens=4, step=step, run_id=host, seed={seed})
    t = time.perf_counter()
    buf.append_rollouts(table, source=f"{{host}}:{{step}}")
    lat.append(time.perf_counter() - t)
buf.close()
print(" ".join(f"{{x:.6f}}" for x in lat), flush=True)
"""


def appender_script(root: str, buffer: str, n: int, group: int = 2, seed: int = 0) -> str:
    return APPENDER.format(root=root, buffer=buffer, n=n, group=group, seed=seed)


def check_invariants(buffer: str) -> list[str]:
    """Every violation found (empty: all hold):
    - every live row's file exists, with the size and sha256 the catalog records;
    - no rollout_id in two live rows (read from the shards), and `rollout_ids` names exactly them;
    - commit seqs are exactly 1..latest, and every shard's added/removed seq is one of them;
    - no shard path twice among the rows."""
    bad: list[str] = []
    with Buffer.open(buffer) as buf:
        man = buf.manifest
        seqs = [r[0] for r in man.con.execute("SELECT seq FROM commits ORDER BY seq")]
        if seqs != list(range(1, len(seqs) + 1)):
            bad.append(f"commit seqs not contiguous: {seqs[:5]}... ({len(seqs)} commits, max {max(seqs, default=0)})")
        latest = man.latest_seq()
        rows = man.con.execute("SELECT path, added_seq, removed_seq FROM shards").fetchall()
        paths = [r[0] for r in rows]
        if len(paths) != len(set(paths)):
            bad.append("a shard path is named twice")
        for path, added, removed in rows:
            if not 1 <= added <= latest or (removed is not None and not added < removed <= latest):
                bad.append(f"{path}: seqs {added}..{removed} outside 1..{latest}")
        seen: set[str] = set()
        for shard in man.shards():
            full = os.path.join(buf.root, shard.path)
            if not os.path.exists(full):
                bad.append(f"{shard.path}: live row, no file")
                continue
            with open(full, "rb") as f:
                data = f.read()
            if len(data) != shard.bytes or hashlib.sha256(data).hexdigest() != shard.sha256:
                bad.append(f"{shard.path}: size or sha256 differs from the catalog")
            if shard.table_name == "rollouts":
                ids = pq.read_table(full, columns=["rollout_id"]).column("rollout_id").to_pylist()
                for rid in ids:
                    if rid in seen:
                        bad.append(f"rollout_id {rid} twice")
                    seen.add(rid)
        registered = {r[0] for r in man.con.execute("SELECT rollout_id FROM rollout_ids")}
        if registered != seen:
            bad.append(f"rollout_ids holds {len(registered)} ids, the live shards {len(seen)}")
    return bad
