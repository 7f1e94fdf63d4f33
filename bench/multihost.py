"""Append throughput of a buffer: embedded SQLite manifest vs a PostgreSQL catalog, 1 and 4 writer
processes (issue 36's commit-rate table).

Each writer is a process (its own host id, its own catalog connection) that opens the buffer,
waits at a barrier, then appends `--appends` small rollouts shards (one group of 2 rows each) and
reports each append's latency. Commits/s = all appends / (last end - first start after the barrier).
PostgreSQL: --dsn, else ROLLSTORE_TEST_PG_DSN, else a server started from the machine's binaries
(tests/pg_server.py) with fsync and synchronous_commit on (as durable as SQLite's synchronous=FULL).

    .venv/bin/python -m bench.multihost [--appends 40] [--writers 1 4] [--rounds 3] [--big ROWS] [--s3]
    .venv/bin/python -m bench.multihost --s3 --dry-run APPENDS   # d3s dry runs, embedded vs PG + S3

(With --s3, all writers of the "pg+s3" rows share one host-local cache folder: the bench measures
the commit path, upload included.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WRITER = """
import contextlib, os, sys, time, json
sys.path.insert(0, {root!r})
from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer
host = os.environ["ROLLSTORE_HOST_ID"]
buf = Buffer.open({buffer!r})
held = []  # seconds each manifest transaction held the buffer's write lock (after BEGIN returned, to COMMIT done)
_transaction = buf.manifest.transaction
@contextlib.contextmanager
def timed():
    with _transaction() as con:
        t0 = time.perf_counter()
        yield con
    held.append(time.perf_counter() - t0)
buf.manifest.transaction = timed
tables = [rollouts_table(n_groups=1, group_size=2, mean_tokens=16, step=s, run_id=host) for s in range({n})]
open({ready!r} + host, "w").close()
while not os.path.exists({go!r}):
    time.sleep(0.005)
start = time.time()
cpu0 = sum(os.times()[:2])
lat = []
for t in tables:
    a = time.perf_counter()
    buf.append_rollouts(t, source=host)
    lat.append(time.perf_counter() - a)
end = time.time()
cpu = sum(os.times()[:2]) - cpu0
buf.close()
print(json.dumps({{"start": start, "end": end, "lat": lat, "cpu": cpu, "held": held}}), flush=True)
"""


def run(buffer: str, writers: int, n: int, work: str) -> dict:
    go = os.path.join(work, f"go-{os.path.basename(buffer)}-{writers}")
    ready = os.path.join(work, f"ready-{os.path.basename(buffer)}-{writers}-")
    script = os.path.join(work, "writer.py")
    with open(script, "w") as f:
        f.write(WRITER.format(root=ROOT, buffer=buffer, n=n, ready=ready, go=go))
    procs = [subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "ROLLSTORE_HOST_ID": f"w{writers}-{i}", "OMP_NUM_THREADS": "1"})
             for i in range(writers)]
    while sum(os.path.exists(f"{ready}w{writers}-{i}") for i in range(writers)) < writers:
        if any(p.poll() is not None for p in procs):
            raise SystemExit("a writer failed before the barrier")
        time.sleep(0.01)
    busy0 = _machine_busy()
    open(go, "w").close()
    results = [json.loads(p.communicate()[0]) for p in procs]
    busy1 = _machine_busy()
    if any(p.returncode for p in procs):
        raise SystemExit("a writer failed")
    lat = sorted(x for r in results for x in r["lat"])
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"writers": writers, "commits": len(lat), "commits_per_s": len(lat) / wall,
            "p50_ms": 1000 * lat[len(lat) // 2], "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "held_ms": 1000 * sorted(h for r in results for h in r["held"])[len(lat) // 2],
            "writer_cpu_ms": 1000 * sum(r["cpu"] for r in results) / len(lat),
            "machine_busy": (busy1[0] - busy0[0]) / max(1e-9, busy1[1] - busy0[1])}


def _table(rows: list[dict]) -> None:
    """Medians over rounds per (catalog, writers), and each round's cataloged/SQLite ratio."""
    import statistics

    print("\n| catalog | writers | commits/s (median) | p50 ms | p99 ms | lock held p50 ms | writer CPU ms/commit "
          "| machine busy | / SQLite, per round |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for writers in sorted({r["writers"] for r in rows}):
        base = {r["round"]: r["commits_per_s"] for r in rows if r["writers"] == writers and r["catalog"] == "sqlite"}
        for kind in dict.fromkeys(r["catalog"] for r in rows):
            mine = [r for r in rows if r["writers"] == writers and r["catalog"] == kind]
            med = {k: statistics.median(r[k] for r in mine) for k in
                   ("commits_per_s", "p50_ms", "p99_ms", "held_ms", "writer_cpu_ms", "machine_busy")}
            ratios = ", ".join(f"{r['commits_per_s'] / base[r['round']]:.2f}×" for r in mine)
            print(f"| {kind} | {writers} | {med['commits_per_s']:.1f} | {med['p50_ms']:.1f} | {med['p99_ms']:.1f} | "
                  f"{med['held_ms']:.1f} | {med['writer_cpu_ms']:.1f} | {100 * med['machine_busy']:.0f}% | {ratios} |")


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of every CPU of this machine so far (/proc/stat; (0, 1) elsewhere):
    the share of the machine the run kept busy (its writers, the database server, and anything else
    running), to tell a CPU-bound run from a lock-bound one."""
    try:
        with open("/proc/stat") as fh:
            fields = [float(x) for x in fh.readline().split()[1:]]
    except OSError:
        return 0.0, 1.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def dry_runs(work: str, appends: int, dsn: str, url: str) -> None:
    """d3s dry runs: embedded vs PostgreSQL + S3 read through another host's warm cache."""
    import statistics

    import rollstore as rs
    from rollstore.storage.buffer import Buffer
    from rollstore.builtin.synthetic import rollouts_table

    tables = [rollouts_table(n_groups=8, group_size=4, mean_tokens=16, step=s, run_id="bench") for s in range(appends)]
    embedded, writer, reader = (os.path.join(work, n) for n in ("embedded", "writer", "reader"))
    for root, kw in ((embedded, {}), (writer, {"catalog": dsn, "data": url})):
        with Buffer.init(root, **kw) as buf:
            for t in tables:
                buf.append_rollouts(t)
    Buffer.init(reader, catalog=dsn, data=url).close()
    for name, root in (("embedded", embedded), ("pg+s3, another host", reader)):
        first = time.perf_counter()
        cid = rs.open(root).curate("d3s", dry_run=True).id  # the reader's first run fills its cache
        first = time.perf_counter() - first
        times = []
        for _ in range(3):
            t = time.perf_counter()
            assert rs.open(root).curate("d3s", dry_run=True).id == cid
            times.append(time.perf_counter() - t)
        print(f"{name:22s} d3s dry run: first {first:.2f} s, warm median {statistics.median(times):.2f} s "
              f"({', '.join(f'{x:.2f}' for x in times)}); curation {cid}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--appends", type=int, default=40, help="appends per writer")
    ap.add_argument("--writers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=1, help="repeat the whole table, interleaved")
    ap.add_argument("--dsn", default=os.environ.get("ROLLSTORE_TEST_PG_DSN"))
    ap.add_argument("--big", type=int, default=0, metavar="ROWS",
                    help="also time two appends of ROWS rows each (groups of 8) into each catalog")
    ap.add_argument("--s3", action="store_true",
                    help="also PostgreSQL + S3 (moto's server on 127.0.0.1: objects uploaded with put-if-absent)")
    ap.add_argument("--dry-run", type=int, default=0, metavar="APPENDS",
                    help="instead: d3s dry runs over APPENDS appends (8 groups of 4 each) in an embedded buffer and "
                         "a PostgreSQL + S3 one read by another host with a warm cache (median of 3 each); needs --s3")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from rollstore.storage.buffer import Buffer

    server = None
    if args.dsn is None:
        import pg_server

        server = pg_server.start(durable=True)
    s3 = None
    if args.s3:
        import s3_server

        s3 = s3_server.start()
        os.environ.update(s3_server.environment(s3))
    try:
        rows = []
        if args.dry_run:
            if s3 is None:
                raise SystemExit("--dry-run needs --s3")
            with tempfile.TemporaryDirectory(prefix="rollstore-bench-mh-") as work:
                dry_runs(work, args.dry_run, server.fresh_dsn() if server else args.dsn, s3.fresh_url())
            return
        with tempfile.TemporaryDirectory(prefix="rollstore-bench-mh-") as work:
            for rnd in range(args.rounds):  # rounds interleave the catalogs: the machine's noise hits each alike
                for writers in args.writers:
                    for kind in ("sqlite", "postgres") + (("pg+s3",) if s3 else ()):
                        buffer = os.path.join(work, f"{kind}-{writers}-{rnd}")
                        if kind == "sqlite":
                            Buffer.init(buffer).close()
                        else:
                            dsn = server.fresh_dsn() if server else args.dsn
                            Buffer.init(buffer, catalog=dsn, data=s3.fresh_url() if kind == "pg+s3" else None).close()
                        rows.append({"catalog": kind, "round": rnd, **run(buffer, writers, args.appends, work)})
                        r = rows[-1]
                        print(f"round {rnd} {r['catalog']:8s} writers={r['writers']} commits={r['commits']} "
                              f"{r['commits_per_s']:.1f}/s p50={r['p50_ms']:.1f}ms p99={r['p99_ms']:.1f}ms "
                              f"lock-held p50={r['held_ms']:.1f}ms writer-cpu={r['writer_cpu_ms']:.1f}ms/commit "
                              f"machine-busy={100 * r['machine_busy']:.0f}%", flush=True)
            _table(rows)
            if args.big:
                from rollstore.builtin.synthetic import rollouts_table

                for kind in ("sqlite", "postgres"):
                    buffer = os.path.join(work, f"{kind}-big")
                    buf = Buffer.init(buffer, catalog=None if kind == "sqlite" else
                                      (server.fresh_dsn() if server else args.dsn))
                    for step in range(2):
                        table = rollouts_table(n_groups=args.big // 8, group_size=8, mean_tokens=4, step=step)
                        t = time.perf_counter()
                        buf.append_rollouts(table)
                        print(f"{kind:8s} one append of {table.num_rows} rows: {time.perf_counter() - t:.2f} s", flush=True)
                    buf.close()
    finally:
        if server is not None:
            server.stop()
        if s3 is not None:
            s3.stop()


if __name__ == "__main__":
    main()
