"""The same curation on the embedded engine and on dask.distributed (`local:N`), side by side.

For a generated buffer of N tokens, each recipe runs twice, each run in a fresh child process on its
own copy of the buffer: (a) the embedded engine (DuckDB in the process); (b) `--engine dask` on a
LocalCluster of N one-thread worker processes started by the child (the cluster's start-up is timed
apart). Reported: wall time of the curation (commit included), the peak RSS of the client process
and of each worker process (`ru_maxrss`, so worker baselines — Python, dask, DuckDB — are included;
the baseline RSS of a fresh worker is given beside it), and whether the two runs produced the same
curation id and byte-identical curated shards and audit. Appends the table to bench/RESULTS.md.

    python -m bench.dask_curation --tokens 10_000_000 --recipes d3s da3po --workers 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

from bench import common  # noqa: E402

NOTE = """\
Where the distributed plan pays off: not on this machine. `local:2` competes for the same two
cores as the embedded engine, which already runs DuckDB on both, and adds fixed costs: one DuckDB
session per task (tens of ms), Arrow hand-offs between processes, the shuffle of narrow rows to
prompt partitions and round trips to the client for μ, the cross-group pool and the token
threshold. Those costs grow with the number of tasks (input shards + partitions + output shards),
not with tokens. The token work is split by input shard (scoring, the threshold's two passes)
and materialisation by output shard; here the whole curated output fits one ~96 MB output shard,
so it is one task, as it is one loop in the embedded engine. The plan pays off when the buffer
outgrows one machine (disk, memory, or the time one host takes to read it): with W worker hosts on
shared storage, the Parquet scans, scoring and the writing of many output shards run W-wide, while
what must stay in one process is bounded by candidates, never tokens — the cross-group pool's
(rollout_id, advantage) pairs on the client and every candidate's narrow row in the task that
writes the single audit file (the embedded engine's own bound for the audit)."""


def _hash_files(root: str, paths: list[str]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.encode())
        with open(os.path.join(root, p), "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def _worker_rss() -> dict:
    import resource

    import psutil

    return {"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_mib": psutil.Process().memory_info().rss / 2**20}


def child(kind: str, root: str, recipe: str, progress: str, workers: int, memory_limit: str) -> dict:
    from rollstore.curate.options import Dask, Limits
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.storage.buffer import Buffer

    sets = {"where": "true", "progress": progress}
    out: dict = {}
    if kind == "embedded":
        t0 = time.perf_counter()
        with Buffer.open(root) as buf:
            r = curate(buf, load_recipe(recipe), sets, limits=Limits(memory_limit))
        out["seconds"] = time.perf_counter() - t0
    else:
        import distributed

        t0 = time.perf_counter()
        with distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                      dashboard_address=":0") as cluster, distributed.Client(cluster) as client:
            client.wait_for_workers(workers)
            out["startup_seconds"] = time.perf_counter() - t0
            out["worker_baseline_mib"] = max(v["rss_mib"] for v in client.run(_worker_rss).values())
            t0 = time.perf_counter()
            with Buffer.open(root) as buf:
                r = curate(buf, load_recipe(recipe), sets, limits=Limits(memory_limit), engine=Dask(client))
            out["seconds"] = time.perf_counter() - t0
            out["worker_peak_mib"] = sorted(v["peak_mib"] for v in client.run(_worker_rss).values())
    out.update(curation_id=r.curation_id, n_selected=r.record["n_selected"], tokens_kept=r.record["tokens_kept"],
               files=len(r.output_files), digest=_hash_files(root, r.output_files))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--shard-tokens", type=int, default=1_000_000)
    ap.add_argument("--recipes", nargs="+", default=["d3s", "da3po"])
    ap.add_argument("--progress", default="0.5")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="runs per engine (fresh child and buffer copy each); the fastest is kept")
    ap.add_argument("--memory-limit", default="1GB")
    ap.add_argument("--buffer", help="reuse (or create) the generated buffer here")
    ap.add_argument("--no-append", action="store_true", help="print the table, do not append it to RESULTS.md")
    ap.add_argument("--child", nargs=6, metavar=("KIND", "ROOT", "RECIPE", "PROGRESS", "WORKERS", "MEMORY"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, root, recipe, progress, workers, memory = args.child
        common.child_result(child(kind, root, recipe, progress, int(workers), memory))
        return

    scratch = tempfile.mkdtemp(prefix="rs-bench-dask-")
    try:
        template = args.buffer or os.path.join(scratch, "template")
        info = common.build_buffer(template, args.tokens, args.shard_tokens)
        rows = []
        for recipe in args.recipes:
            results = {}
            for _ in range(max(1, args.repeat)):
                for kind in ("embedded", "dask"):  # alternate, so both see the same background load
                    root = os.path.join(scratch, f"{recipe}-{kind}")
                    shutil.copytree(template, root)
                    res = common.run_child("bench.dask_curation", [
                        "--child", kind, root, recipe, args.progress, args.workers, args.memory_limit], timeout=3600)
                    shutil.rmtree(root, ignore_errors=True)
                    res["runs"] = results.get(kind, {}).get("runs", []) + [round(res["seconds"], 2)]
                    if kind not in results or res["seconds"] < results[kind]["seconds"]:
                        results[kind] = res
                    else:
                        results[kind]["runs"] = res["runs"]
            e, d = results["embedded"], results["dask"]
            same = e["curation_id"] == d["curation_id"] and e["digest"] == d["digest"]
            rows.append([f"{recipe}: embedded", e["seconds"], " / ".join(map(str, e["runs"])), 1.0,
                         e["peak_rss_mib"], "", "", e["files"], ""])
            rows.append([f"{recipe}: dask local:{args.workers}", d["seconds"], " / ".join(map(str, d["runs"])),
                         d["seconds"] / e["seconds"],
                         d["peak_rss_mib"], " / ".join(f"{x:.0f}" for x in d["worker_peak_mib"]),
                         d["worker_baseline_mib"], d["files"], same])
            print(json.dumps({"recipe": recipe, "embedded": e, "dask": d}), flush=True)
        startup = results["dask"]["startup_seconds"]
        table = common.md_table(
            ["run", "seconds (best)", "all runs", "× embedded", "client peak RSS (MiB)", "peak RSS per worker (MiB)",
             "fresh worker RSS (MiB)", "output files", "byte-identical"], rows)
        text = "\n\n".join([
            common.header("Curation: embedded engine vs dask.distributed", extra=[
                f"Buffer: {info['tokens']:,} tokens, {info['rows']} rollouts in {info['shards']} shards, "
                f"{info['bytes'] / 2**20:.1f} MiB on disk; `where = true`, progress {args.progress}; DuckDB "
                f"memory_limit {args.memory_limit} per session (per task on Dask); LocalCluster of "
                f"{args.workers} worker processes × 1 thread, start-up {startup:.1f} s (not in the times)"],
                libs=("duckdb", "pyarrow", "dask", "distributed")),
            table, NOTE])
        print(text)
        if not args.no_append:
            common.append_results(text)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
