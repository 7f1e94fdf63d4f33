"""Growth: curation time at 1×, 2× and 4× the batch size, in one fixed buffer.

The buffer holds one shard per step (default: the 10 M-token buffer of the curation benchmark,
1 M tokens per step). The batch is the first k steps (`where = step < k`) for k = base, 2·base,
4·base; each run is a fresh child process. Besides `rollstore curate` for each recipe, the scan
floor over the same batch and the in-memory reference for `d3s` (which loads only the batch's
shards) are timed, so the table shows how each cost grows with work. The growth exponent is the
least-squares slope of log seconds on log batch tokens (1 = proportional to the batch, 0 = a
fixed cost).

    python -m bench.growth --tokens 10_000_000 --base-steps 2
"""

from __future__ import annotations

import argparse

from bench import common
from bench.curation import run_one
from bench.memory import slope


def batch_tokens(root: str, k: int) -> tuple[int, int]:
    from rollstore.storage.buffer import Buffer

    with Buffer.open(root) as buf, buf.snapshot() as snap:
        shards = snap.shards("rollouts")[:k]
    return sum(s.tokens for s in shards), sum(s.rows for s in shards)


def measure(root: str, recipes=("d3s", "da3po"), base_steps: int = 2, memory_limit: str = "1GB",
            progress: str = "0", repeat: int = 1) -> dict:
    info = common.describe(root)
    ks = [base_steps, 2 * base_steps, 4 * base_steps]
    if ks[-1] > info["shards"]:
        raise SystemExit(f"growth: the buffer has {info['shards']} steps, 4 × {base_steps} are needed")
    rows = []
    for k in ks:
        tokens, n_rows = batch_tokens(root, k)
        where = f"step < {k}"
        runs = {"scan floor": common.best_of(
            lambda w=where: run_one("floor", root, memory_limit=memory_limit, where=w), repeat)}
        if "d3s" in recipes:
            runs["d3s in-memory reference"] = common.best_of(
                lambda k=k: run_one("reference", root, "d3s", memory_limit, progress, first_shards=k), repeat)
        for recipe in recipes:
            runs[f"rollstore {recipe}"] = common.best_of(
                lambda r=recipe, w=where: run_one("curate", root, r, memory_limit, progress, where=w), repeat)
        rows.append({"k": k, "tokens": tokens, "rows": n_rows, "runs": runs})
    names = list(rows[0]["runs"])
    slopes = {n: slope([r["tokens"] for r in rows], [r["runs"][n]["seconds"] for r in rows]) for n in names}
    return {"info": info, "rows": rows, "slopes": slopes, "memory_limit": memory_limit, "progress": progress,
            "repeat": repeat, "base_steps": base_steps}


def tables(m: dict) -> str:
    names = list(m["rows"][0]["runs"])
    base = m["rows"][0]
    out_rows = []
    for r in m["rows"]:
        mult = r["tokens"] / base["tokens"]
        cells = [f"{r['k'] // m['base_steps']}× ({r['k']} steps)", r["tokens"], r["rows"]]
        for n in names:
            s = r["runs"][n]["seconds"]
            cells.append(f"{s:.2f} s ({s / base['runs'][n]['seconds']:.2f}×)")
        cells.append(f"{mult:.2f}×")
        out_rows.append(cells)
    out_rows.append(["growth exponent (log-log slope)", None, None] + [f"{m['slopes'][n]:.2f}" for n in names] + ["1.00"])
    return common.md_table(["batch", "tokens", "rollouts"] + names + ["work"], out_rows)


def section(m: dict, command: str | None = None, level: int = 3) -> str:
    info = m["info"]
    extra = [f"Buffer: {info['tokens']:,} response tokens in {info['shards']} shards (one per step); batch = the "
             f"first k steps (`where = step < k`); DuckDB memory_limit {m['memory_limit']}; progress {m['progress']}; "
             f"each cell: seconds (× the 1× batch), best of {m['repeat']} fresh-process runs"]
    return (common.header("Growth: curation time at 1×, 2×, 4× the batch", command, extra, level) + "\n\n"
            + common.method(__doc__) + "\n\n" + tables(m))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--shard-tokens", type=int, default=1_000_000)
    ap.add_argument("--base-steps", type=int, default=2)
    ap.add_argument("--recipes", nargs="+", default=["d3s", "da3po"])
    ap.add_argument("--memory-limit", default="1GB")
    ap.add_argument("--progress", default="0")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--root", default=None)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    m = common.measured_buffer(a.root, "rs-bench-growth-", a.tokens, a.shard_tokens,
                               lambda root: measure(root, a.recipes, a.base_steps, a.memory_limit, a.progress, a.repeat))
    common.publish(section(m), record=not a.no_record)


if __name__ == "__main__":
    main()
