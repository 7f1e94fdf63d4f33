"""Beyond memory: curating a buffer several times larger than DuckDB's memory limit.

One buffer is grown through three sizes (default 8, 16 and 32 M response tokens in shards of
0.5 M tokens); at each size the recipes curate the whole buffer (`where = true`) in a fresh child
process under a tight DuckDB `memory_limit` (default 64MB). Reported per run: seconds, seconds per
million tokens, the child's peak RSS, its RSS after imports (the baseline every Python process with
duckdb + pyarrow pays), and whether peak − baseline stays within the limit plus the stated margin.
Time should grow linearly: the log-log slope of seconds against tokens is reported (1 = linear).

Why these numbers (measured while writing this benchmark): DuckDB spills its own operators, but
two things set the smallest limit that completes. Curated rows are materialised input shard by
input shard, so the largest shard bounds that step (1 M-token shards need 64 MB, 0.5 M-token
shards complete at 32 MB on small buffers; 16 MB fails for both). And the row-level temp tables of
the run (`work` and the stage outputs, a few hundred bytes per candidate rollout, about 1 byte per
response token here) stay resident: `d3s` over 8 M tokens needs more than 32 MB, 32 M tokens more
than 40 MB (48 MB completes, but slowly, spilling). 64 MB leaves headroom at every size here.

Peak RSS, measured with a sampling probe per stage, peaks while the curated shards are written:
curated rows accumulate in Arrow up to one output shard (96 MiB) and are concatenated before the
write; besides that, the audit of the batch and the kept-row ids are built in Arrow and Python and
grow with the number of candidate rollouts. The stated margin is exactly that: 192 MiB + 1 KiB per
candidate rollout, above the limit and the import baseline.

    python -m bench.memory --sizes 8000000 16000000 32000000 --memory-limit 64MB
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile

from bench import common
from bench.curation import run_one

MARGIN_FIXED_MIB = 192  # one curated output shard pending in Arrow + its concatenation (2 × 96 MiB)
MARGIN_PER_ROLLOUT_KIB = 1.0  # the batch's audit rows and kept-row ids, built in Arrow/Python


def parse_bytes(text: str) -> float:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            return float(t[: -len(u)]) * units[u]
    return float(t)


def slope(xs, ys) -> float:
    """Least-squares slope of log(y) on log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else float("nan")


def measure(sizes, recipes=("d3s", "da3po"), memory_limit: str = "64MB", shard_tokens: int = 500_000,
            root: str | None = None, repeat: int = 1, reference_limit: str | None = "1GB") -> dict:
    own = root is None
    root = root or tempfile.mkdtemp(prefix="rs-bench-mem-")
    runs = []
    try:
        for size in sorted(sizes):
            info = common.build_buffer(root, size, shard_tokens)
            for recipe in recipes:
                r = common.best_of(lambda rec=recipe: run_one("curate", root, rec, memory_limit), repeat)
                runs.append({"size": size, "info": info, "recipe": recipe, "limit": memory_limit, **r})
        if reference_limit:  # the largest size again without the tight limit: what the limit costs
            for recipe in recipes[:1]:
                r = common.best_of(lambda rec=recipe: run_one("curate", root, rec, reference_limit), repeat)
                runs.append({"size": size, "info": info, "recipe": recipe, "limit": reference_limit, **r})
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    limit_mib = parse_bytes(memory_limit) / 2**20
    for r in runs:
        r["above_baseline_mib"] = r["peak_rss_mib"] - r["baseline_rss_mib"]
        r["margin_mib"] = MARGIN_FIXED_MIB + MARGIN_PER_ROLLOUT_KIB * r["info"]["rows"] / 1024
        r["within"] = r["above_baseline_mib"] <= parse_bytes(r["limit"]) / 2**20 + r["margin_mib"]
    tight = [r for r in runs if r["limit"] == memory_limit]
    slopes = {rec: slope([r["info"]["tokens"] for r in tight if r["recipe"] == rec],
                         [r["seconds"] for r in tight if r["recipe"] == rec]) for rec in recipes}
    return {"runs": runs, "memory_limit": memory_limit, "limit_mib": limit_mib, "shard_tokens": shard_tokens,
            "slopes": slopes, "repeat": repeat}


def tables(m: dict) -> str:
    rows = []
    for r in m["runs"]:
        info = r["info"]
        on_disk = info["bytes"] / 2**20
        limit = parse_bytes(r["limit"])
        rows.append([r["recipe"], r["limit"], info["tokens"], info["shards"], on_disk, f"{info['bytes'] / limit:.1f}×",
                     r["seconds"], r["seconds"] / (info["tokens"] / 1e6), r["peak_rss_mib"], r["baseline_rss_mib"],
                     r["above_baseline_mib"], r.get("arrow_peak_mib"), r["margin_mib"], r["within"]])
    out = [common.md_table(["recipe", "memory_limit", "tokens", "shards", "MiB on disk", "buffer / limit", "seconds",
                            "s per M tokens", "peak RSS (MiB)", "baseline RSS", "peak − baseline", "of which Arrow peak",
                            "margin (MiB)", "≤ limit + margin"], rows)]
    out.append("")
    out.append("Growth of time with size (least-squares slope of log seconds on log tokens; 1.00 = linear): "
               + ", ".join(f"{k} {v:.2f}" for k, v in m["slopes"].items()) + ".")
    return "\n".join(out)


def section(m: dict, command: str | None = None, level: int = 3) -> str:
    extra = [f"DuckDB memory_limit {m['memory_limit']} ({m['limit_mib']:.1f} MiB); shards of about "
             f"{m['shard_tokens']:,} tokens (the largest input shard bounds one materialisation step); buffer / limit "
             "compares bytes on disk (zstd); decoded in memory the buffer is about 1.5× that",
             f"Stated margin above the limit, for what lives outside DuckDB's buffer manager: {MARGIN_FIXED_MIB} MiB "
             "(one curated output shard of 96 MiB pending in Arrow plus its concatenation while it is written) + "
             f"{MARGIN_PER_ROLLOUT_KIB:g} KiB per candidate rollout (the batch's audit rows and kept-row ids, built in "
             "Arrow and Python); baseline = the child's RSS after importing duckdb, pyarrow and rollstore, before "
             "curating; \"of which Arrow\" = peak of pyarrow's memory pool",
             f"One fresh process per run, best of {m['repeat']}; each size is the previous buffer extended (the same "
             "rollouts plus new steps); the last row repeats the largest size without the tight limit"]
    return (common.header("Beyond memory: curation under a tight DuckDB memory limit", command, extra, level) + "\n\n"
            + common.method(__doc__) + "\n\n" + tables(m))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs=3, default=[8_000_000, 16_000_000, 32_000_000])
    ap.add_argument("--recipes", nargs="+", default=["d3s", "da3po"])
    ap.add_argument("--memory-limit", default="64MB")
    ap.add_argument("--shard-tokens", type=int, default=500_000)
    ap.add_argument("--reference-limit", default="1GB", help="rerun the largest size at this limit ('' to skip)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--root", default=None)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    m = measure(a.sizes, a.recipes, a.memory_limit, a.shard_tokens, a.root, a.repeat, a.reference_limit or None)
    common.publish(section(m), record=not a.no_record)


if __name__ == "__main__":
    main()
