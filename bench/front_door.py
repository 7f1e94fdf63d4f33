"""A curation handle's rows as Polars (`rollstore.open(root).curation(id).curated`) against
`pl.read_parquet` of the same rows from a `rollstore export` of that curation (issue 34: ≤ 1.2×).

A generated buffer of about `--tokens` response tokens (`bench.common.build_buffer`) is curated once
(`--recipe`, `--progress`) and exported once. Each round then runs, in fresh child processes and in
alternating order, (a) the handle: open the buffer, take the curation's handle, read `.curated`
(its thin shards resolved against the rollouts shards they refer to, this curation's alone), and
(b) `pl.read_parquet` of the export's `curated/` folder (the same rows, materialised). Only the read
is timed (imports excluded). The median of the per-round ratios is reported beside the fastest of
each.

    python -m bench.front_door --tokens 10000000 --rounds 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import os
import shutil
import statistics
import tempfile
import time

from bench import common


def _handle(root: str, curation_id: str) -> dict:
    import polars  # noqa: F401  (imports are not timed, on either side)

    import rollstore as rs
    import rollstore.curation  # noqa: F401
    import rollstore.handle  # noqa: F401
    import rollstore.storage.references  # noqa: F401

    t0 = time.perf_counter()
    rows = rs.open(root).curation(curation_id).curated
    return {"seconds": time.perf_counter() - t0, "rows": rows.height,
            "tokens": int(rows["response_token_ids"].list.len().sum())}


def _export(folder: str) -> dict:
    import polars as pl

    files = sorted(glob.glob(os.path.join(folder, "curated", "*.parquet")))
    t0 = time.perf_counter()
    rows = pl.read_parquet(files)
    return {"seconds": time.perf_counter() - t0, "rows": rows.height,
            "tokens": int(rows["response_token_ids"].list.len().sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--recipe", default="d3s")
    ap.add_argument("--progress", default="0.3")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--root", default=None, help="Keep the generated buffer here (default: a temporary folder).")
    ap.add_argument("--child", choices=("handle", "export"), default=None)
    ap.add_argument("--path", default=None)
    ap.add_argument("--curation", default=None)
    ap.add_argument("--no-record", action="store_true", help="Do not append to bench/RESULTS.md.")
    args = ap.parse_args()
    if args.child == "handle":
        common.child_result(_handle(args.path, args.curation))
        return
    if args.child == "export":
        common.child_result(_export(args.path))
        return

    work = tempfile.mkdtemp(prefix="rollstore-front-door-")
    root = args.root or os.path.join(work, "buf")
    try:
        info = common.build_buffer(root, args.tokens)
        import rollstore as rs
        from rollstore.output.export import export_snapshot
        from rollstore.storage.buffer import Buffer

        cur = rs.open(root).curate(args.recipe, progress=float(args.progress), where="true")
        out = os.path.join(work, "export")
        with Buffer.open(root) as buf:
            export_snapshot(buf, out)
        rounds = []
        for k in range(args.rounds):
            order = ("handle", "export") if k % 2 == 0 else ("export", "handle")
            got = {}
            for kind in order:
                path = root if kind == "handle" else out
                extra = ["--curation", cur.id] if kind == "handle" else []
                got[kind] = common.run_child("bench.front_door", ["--child", kind, "--path", path, *extra])
            assert got["handle"]["rows"] == got["export"]["rows"] and got["handle"]["tokens"] == got["export"]["tokens"]
            rounds.append(got)
            print(f"round {k + 1}: handle {got['handle']['seconds']:.3f} s, read_parquet {got['export']['seconds']:.3f} s, "
                  f"ratio {got['handle']['seconds'] / got['export']['seconds']:.2f}", flush=True)
        ratios = [r["handle"]["seconds"] / r["export"]["seconds"] for r in rounds]
        best_h = min(r["handle"]["seconds"] for r in rounds)
        best_e = min(r["export"]["seconds"] for r in rounds)
        rows, tokens = rounds[0]["handle"]["rows"], rounds[0]["handle"]["tokens"]
        summary = (f"median ratio {statistics.median(ratios):.2f} (rounds: {', '.join(f'{x:.2f}' for x in ratios)}); "
                   f"fastest handle {best_h:.3f} s, fastest read_parquet {best_e:.3f} s; "
                   f"{rows:,} curated rows, {tokens:,} response tokens of {info['tokens']:,}")
        print(summary)
        if not args.no_record:
            table = common.md_table(["round", "handle .curated (s)", "pl.read_parquet of the export (s)", "ratio"],
                                    [[k + 1, r["handle"]["seconds"], r["export"]["seconds"], x]
                                     for k, (r, x) in enumerate(zip(rounds, ratios))], digits=3)
            with open(common.RESULTS, "a", encoding="utf-8") as fh:
                fh.write(f"\n## Front door: a curation handle's rows against read_parquet of its export "
                         f"({dt.date.today().isoformat()})\n\n"
                         f"`{common.command_line()}`; {common.machine()}; "
                         f"{common.versions('duckdb', 'pyarrow', 'polars', 'numpy')}; code {common.commit()}; "
                         f"load average {common.load_avg()}.\n\n"
                         f"Buffer: {info['tokens']:,} response tokens in {info['shards']} shards; curation "
                         f"`{args.recipe}` at progress {args.progress}. Target: handle ≤ 1.2× read_parquet.\n\n"
                         f"{table}\n\n{summary}.\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
