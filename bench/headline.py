"""Headline: `d3s` over a very large buffer on this machine, dry run and full curation.

Outside the default `make bench`. For each size (a buffer grown step by step, kept between sizes,
so the larger run reuses the smaller's shards), three fresh child processes: the scan floor (one
DuckDB scan over the columns a d3s curation needs, computing the same |A|·H token scores, no
selection: `bench.curation`'s floor row), then `rollstore curate` with `d3s` over the whole buffer
(`where = true`): `--dry-run` (the record and every candidate's audit row, tokens kept included;
no curated shards) and the full curation (curated shards, audit and record committed). The table
gives dry ÷ floor and full ÷ dry at each size (issue 37's targets: ≤ 1.5× the floor at 1 B). Each reports seconds and peak RSS; the buffer's DuckDB memory_limit bounds
the engine, so RSS should stay near it whatever the size. With more than one size the table gives
the log-log slope of seconds on tokens, which extrapolates to the aim (1 B tokens: dry run under
60 s, full under 2 min, both under 4 GB) when 1 B does not fit the machine's disk or time.

    python -m bench.headline --tokens 1_000_000_000 --shard-tokens 10_000_000 --root /tmp/rs-headline
    python -m bench.headline --tokens 100_000_000 300_000_000   # the largest that fit, and the slope
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from bench import common
from bench.curation import run_one
from bench.memory import slope


def measure(root: str, sizes: list[int], shard_tokens: int, memory_limit: str) -> dict:
    rows = []
    for size in sizes:
        t0 = time.perf_counter()
        info = common.build_buffer(root, size, shard_tokens)
        build = time.perf_counter() - t0
        floor = run_one("floor", root, "d3s", memory_limit)
        dry = run_one("dry", root, "d3s", memory_limit)
        full = run_one("curate", root, "d3s", memory_limit)
        rows.append({"info": info, "build_seconds": build, "floor": floor, "dry": dry, "full": full})
    tokens = [r["info"]["tokens"] for r in rows]
    slopes = {k: slope(tokens, [r[k]["seconds"] for r in rows]) if len(rows) > 1 else None for k in ("dry", "full")}
    return {"rows": rows, "slopes": slopes, "memory_limit": memory_limit, "shard_tokens": shard_tokens}


def extrapolate(m: dict, kind: str, tokens: float = 1e9) -> float | None:
    s = m["slopes"][kind]
    if s is None:
        return None
    last = m["rows"][-1]
    return last[kind]["seconds"] * (tokens / last["info"]["tokens"]) ** s


def tables(m: dict) -> str:
    rows = []
    for r in m["rows"]:
        info = r["info"]
        ratio = {"floor": None, "dry": r["dry"]["seconds"] / r["floor"]["seconds"],
                 "full": r["full"]["seconds"] / r["dry"]["seconds"]}
        for kind, label, what in (("floor", "scan floor", ""), ("dry", "d3s --dry-run", "÷ floor"),
                                  ("full", "d3s full curation", "÷ dry run")):
            x = r[kind]
            rows.append([label, f"{info['tokens']:,}", info["shards"], info["bytes"] / 2**30, x["seconds"],
                         f"{ratio[kind]:.2f} {what}" if ratio[kind] is not None else "",
                         info["tokens"] / x["seconds"] / 1e6, x.get("peak_rss_mib"), x.get("n_selected"),
                         x.get("tokens_kept")])
    out = [common.md_table(["run", "response tokens", "shards", "GiB on disk", "seconds", "ratio", "Mtokens/s",
                            "peak RSS (MiB)", "selected", "tokens kept"], rows)]
    if m["slopes"]["dry"] is not None:
        out += ["", "Growth (log-log slope of seconds on tokens) and the extrapolation to 1 B tokens:", "",
                common.md_table(["run", "slope", "seconds at 1 B (extrapolated)", "aim"],
                                [["d3s --dry-run", m["slopes"]["dry"], extrapolate(m, "dry"), "< 60 s"],
                                 ["d3s full curation", m["slopes"]["full"], extrapolate(m, "full"), "< 120 s"]])]
    return "\n".join(out)


def section(m: dict, command: str | None = None, level: int = 3) -> str:
    extra = [f"DuckDB memory_limit {m['memory_limit']}; generated steps of {m['shard_tokens']:,} tokens; one "
             f"fresh-process run per cell; buffer build times: "
             + ", ".join(f"{r['build_seconds']:.0f} s" for r in m["rows"])]
    return (common.header("Headline: d3s over the largest buffer that fits", command, extra, level) + "\n\n"
            + common.method(__doc__) + "\n\n" + tables(m))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1_000_000_000])
    ap.add_argument("--shard-tokens", type=int, default=10_000_000)
    ap.add_argument("--memory-limit", default="2GB")
    ap.add_argument("--root", default=None, help="grow (and keep) the buffer here")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    root = a.root or tempfile.mkdtemp(prefix="rs-headline-")
    try:
        m = measure(root, sorted(a.tokens), a.shard_tokens, a.memory_limit)
    finally:
        if not a.root:
            shutil.rmtree(root, ignore_errors=True)
    common.publish(section(m), record=not a.no_record)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
