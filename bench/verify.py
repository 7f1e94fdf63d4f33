"""What shard verification costs, and whether the memory limit of `rollstore sql` holds.

For a generated buffer whose rollouts sit in ONE shard of about `--mb` MB:

- **verify** — `storage.verify.verify_shards` of that shard with the per-process cache cleared
  (size check + sha256 of the whole file; the file is in the page cache, as it is right after a
  write or a previous read — a cold read from disk adds the disk's read time);
- **curate d3s** — `rollstore curate BUFFER --recipe d3s --set where=true` in a fresh process,
  which verifies the same shard first; the share is verify / curate;
- **memory bomb** — `rollstore sql BUFFER --timeout 30 --memory-limit 200MB
  "SELECT len(list(range(100000000)))"`: peak RSS of the command and its worker process (polled
  every 5 ms from outside), its exit code and its stderr line.

    python -m bench.verify --mb 100
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from bench import common

BOMB = "SELECT len(list(range(100000000)))"


def tree_rss(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_watched(cmd: list[str]) -> dict:
    """Run `cmd`, polling the RSS of it and its children; return seconds, peak, exit code, stderr."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=common.ROOT)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.005)
    out, err = proc.communicate()
    return {"seconds": time.perf_counter() - start, "peak_rss_mib": peak / 2**20, "code": proc.returncode,
            "stdout": out, "stderr": err.strip()}


def measure(root: str, repeat: int) -> dict:
    from rollstore.storage import verify as v
    from rollstore.storage.buffer import Buffer

    with Buffer.open(root) as buf:
        shards = buf.manifest.shards("rollouts")
    times = []
    for _ in range(repeat):
        v._verified.clear()
        t0 = time.perf_counter()
        v.verify_shards(root, shards)
        times.append(time.perf_counter() - t0)
    rollstore = os.path.join(os.path.dirname(sys.executable), "rollstore")
    curations = []
    for i in range(repeat):
        res = run_watched([rollstore, "curate", root, "--recipe", "d3s", "--set", "where=true",
                           "--set", f"progress=0.{i + 1}"])
        if res["code"] != 0:
            raise RuntimeError(res["stderr"])
        curations.append(res["seconds"])
    bomb = run_watched([rollstore, "sql", root, "--timeout", "30", "--memory-limit", "200MB", BOMB])
    mb = sum(s.bytes for s in shards) / 1e6
    return {"shard_mb": mb, "tokens": sum(s.tokens for s in shards), "verify_s": min(times),
            "curate_s": min(curations), "bomb": bomb}


def section(m: dict) -> str:
    share = m["verify_s"] / m["curate_s"]
    rows = [
        ("verify one shard (size + sha256)", m["verify_s"], f"{m['shard_mb'] / m['verify_s']:.0f} MB/s", ""),
        ("rollstore curate d3s (where=true, incl. verify)", m["curate_s"], "", f"{100 * share:.1f} % is verify"),
        ("rollstore sql memory bomb, --memory-limit 200MB", m["bomb"]["seconds"],
         f"peak RSS {m['bomb']['peak_rss_mib']:.0f} MiB", f"exit {m['bomb']['code']}: {m['bomb']['stderr'][:60]}"),
    ]
    table = common.md_table(["measurement", "seconds", "rate / peak", "note"], rows)
    return "\n".join([
        common.header("Shard verification cost and the sql memory limit",
                      extra=[f"Buffer: one rollouts shard of {m['shard_mb']:.1f} MB ({m['tokens']:,} tokens); "
                             f"commit {common.commit()}"]),
        "", table, "",
        "Verification hashes each shard once per process (cached by path, size, mtime, ctime and inode), before "
        "curate, compact or train use it; `sql` only stats the files. The page cache was warm.",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=20.0, help="size of the one rollouts shard, in MB (about)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--root", default=None)
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    a = ap.parse_args()
    tokens = int(a.mb * 1e6 / 11)  # ~11 bytes per response token on disk (measured)
    m = common.measured_buffer(a.root, "rs-verify-", tokens, tokens, lambda root: measure(root, a.repeat))
    common.publish(section(m), record=not a.no_record)


if __name__ == "__main__":
    main()
