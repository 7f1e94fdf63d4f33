"""Curation speed and memory against the scan floor and an in-memory reference, side by side.

For a generated buffer of N tokens, each measurement runs in a fresh child process (so its peak
RSS is its own):

- **floor** — one DuckDB scan over the same columns computing the same |A|·H token scores
  (advantages from a group-by) without selecting anything: what any engine must at least pay;
- **in-memory reference** (`bench/inmemory.py`) — the trainer's way: pyarrow loads the batch into
  memory, numpy computes advantages, filter/amplification, the max-variance top-M (sort + prefix
  sums) and the top-κ tokens (`np.partition`), and keeps the training batch in memory;
- **rollstore curate** — the recipe over the whole buffer (`where = true`), committing curated
  shards, one audit row per candidate and the record.

Reports seconds (best of `--repeat`), both ratios, tokens per second, peak RSS, the agreement of
the reference with rollstore (same selected rollouts, same tokens kept per rollout, advantages)
and where rollstore's time goes, stage by stage.

    python -m bench.curation --tokens 10_000_000 --recipes d3s da3po --memory-limit 1GB
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from bench import common

FLOOR_SQL = """
WITH adv AS (
    SELECT rollout_id, entropies,
           (reward - avg(reward) OVER g) / (stddev_samp(reward) OVER g + 1e-6) AS a
    FROM rollouts WHERE ({where}) WINDOW g AS (PARTITION BY group_id)
)
SELECT count(*), sum(abs(a) * h) FROM (SELECT a, unnest(entropies) AS h FROM adv)
"""
COPY_SQL = """
COPY (
    SELECT r.rollout_id, r.group_id, r.prompt_id, r.policy_version, r.prompt_token_ids, r.response_token_ids,
           coalesce(r.old_logprobs, r.gen_logprobs) AS old_logprobs, r.gen_logprobs, i.advantage,
           list_transform(r.entropies, lambda h: h > 0) AS loss_mask, 1.0::FLOAT AS weight
    FROM rollouts r JOIN read_parquet('{ids}') i USING (rollout_id)
) TO '{out}' (FORMAT parquet, COMPRESSION zstd, COMPRESSION_LEVEL 3)
"""


# ---------------------------------------------------------------------------------------------
# children (one measurement per fresh process)
# ---------------------------------------------------------------------------------------------

class StageClock:
    """Wall time per curation stage: the named SQL stages, the threshold passes, materialise+commit."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.originals: list[tuple[object, str, object]] = []

    def __enter__(self) -> "StageClock":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, original in reversed(self.originals):
            setattr(owner, attr, original)
        self.originals.clear()

    def wrap(self, owner, attr: str, label=None):
        original = getattr(owner, attr)
        self.originals.append((owner, attr, original))
        clock = self

        def timed(*args, **kwargs):
            name = label(args) if label else attr
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                clock.seconds[name] = clock.seconds.get(name, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)

    def install(self):
        from rollstore.curate.steps import Runner
        from rollstore.storage.buffer import Buffer

        for method in ("run", "rows", "table"):
            self.wrap(Runner, method, lambda a: a[1].sql)
        self.wrap(Buffer, "commit", lambda a: "materialise + write + commit")


def child_floor(root: str, memory_limit: str, where: str) -> dict:
    from rollstore.queries.session import Session
    from rollstore.storage.buffer import Buffer

    base = common.rss_mib()
    t0, c0 = time.perf_counter(), time.process_time()
    with Buffer.open(root) as buf, buf.snapshot() as snap, Session(snap, memory_limit) as s:
        n = s.one(FLOOR_SQL.format(where=where))[0]
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, "baseline_rss_mib": base,
            "scored_tokens": int(n)}


def child_copy(root: str, memory_limit: str, ids: str, out: str) -> dict:
    """The copy floor: one DuckDB COPY of the selected rows' curated columns (ids from a curate
    child's output) to Parquet, with the codec rollstore writes (zstd level 3)."""
    from rollstore.queries.session import Session
    from rollstore.storage.buffer import Buffer

    base = common.rss_mib()
    t0 = time.perf_counter()
    with Buffer.open(root) as buf, buf.snapshot() as snap, Session(snap, memory_limit, sandbox=False) as s:
        s.execute(COPY_SQL.format(ids=ids, out=out))
    return {"seconds": time.perf_counter() - t0, "baseline_rss_mib": base, "peak_rss_mib": common.peak_rss_mib(),
            "bytes": os.path.getsize(out)}


def child_curate(root: str, recipe: str, memory_limit: str, progress: str, where: str, out: str | None,
                 prof: bool, dry_run: bool = False) -> dict:
    from rollstore.curate.options import Limits
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.storage.buffer import Buffer

    base = common.rss_mib()

    def go():
        with Buffer.open(root) as buf:
            return curate(buf, load_recipe(recipe), {"where": where, "progress": progress},
                          limits=Limits(memory_limit), dry_run=dry_run)

    with StageClock() as clock:
        t0, c0 = time.perf_counter(), time.process_time()
        if prof:
            r, top = common.profile(go)
        else:
            r, top = go(), None
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    res = {"seconds": seconds, "cpu_seconds": cpu, "baseline_rss_mib": base, "n_selected": r.record["n_selected"],
           "tokens_kept": r.record["tokens_kept"], "tokens_candidate": r.record["tokens_candidate"],
           "stages": clock.seconds, "profile": top, "peak_rss_mib": common.peak_rss_mib(),
           "arrow_peak_mib": common.arrow_peak_mib()}
    if out and r.audit is not None:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        sel = r.audit.filter(r.audit["selected"])
        pq.write_table(sel.select(["rollout_id", "tokens_kept", "advantage_final"]).rename_columns(
            ["rollout_id", "tokens_kept", "advantage"]).sort_by("rollout_id"), out)
        assert pc.sum(sel["tokens_kept"]).as_py() == r.record["tokens_kept"]
    return res


def child_reference(root: str, recipe: str, progress: str, out: str | None, prof: bool,
                    first_shards: int | None = None) -> dict:
    from fractions import Fraction

    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench.inmemory import RECIPES, curate_in_memory

    files = common.rollout_files(root)[:first_shards or None]
    spec = RECIPES[recipe](Fraction(progress))
    base = common.rss_mib()
    t0 = time.perf_counter()
    if prof:
        r, top = common.profile(lambda: curate_in_memory(files, spec))
    else:
        r, top = curate_in_memory(files, spec), None
    seconds = time.perf_counter() - t0
    res = {"seconds": seconds, "load_seconds": r["load_seconds"], "baseline_rss_mib": base,
           "n_selected": r["batch"].num_rows, "tokens_kept": int(r["tokens_kept"].sum()),
           "profile": top, "peak_rss_mib": common.peak_rss_mib()}
    if out:
        b = r["batch"]
        pq.write_table(pa.table({"rollout_id": b["rollout_id"], "tokens_kept": pa.array(r["tokens_kept"], pa.int32()),
                                 "advantage": b["advantage"]}).sort_by("rollout_id"), out)
    return res


def run_one(kind: str, root: str, recipe: str = "", memory_limit: str = "1GB", progress: str = "0",
            where: str = "true", out: str | None = None, profile: bool = False, first_shards: int = 0,
            ids: str | None = None) -> dict:
    args = ["--child", kind, "--root", root, "--recipe-one", recipe or "d3s", "--memory-limit", memory_limit,
            "--progress", progress, "--where", where, "--first-shards", first_shards]
    if ids:
        args += ["--ids", ids]
    if out:
        args += ["--out", out]
    if profile:
        args += ["--profile"]
    return common.run_child("bench.curation", args)


# ---------------------------------------------------------------------------------------------
# agreement of the reference with rollstore
# ---------------------------------------------------------------------------------------------

def agreement(rollstore_out: str, reference_out: str) -> dict:
    import numpy as np
    import pyarrow.parquet as pq

    a = pq.read_table(rollstore_out)
    b = pq.read_table(reference_out)
    ids_a, ids_b = set(a["rollout_id"].to_pylist()), set(b["rollout_id"].to_pylist())
    same_rows = ids_a == ids_b
    common_ids = a.join(b, "rollout_id", right_suffix="_ref")
    ka = common_ids["tokens_kept"].to_numpy()
    kb = common_ids["tokens_kept_ref"].to_numpy()
    da = np.abs(common_ids["advantage"].to_numpy().astype(np.float64)
                - common_ids["advantage_ref"].to_numpy().astype(np.float64))
    return {"selected": (len(ids_a), len(ids_b)), "same_rollouts": same_rows,
            "only_one_side": len(ids_a ^ ids_b),
            "tokens_kept": (int(a["tokens_kept"].to_numpy().sum()), int(b["tokens_kept"].to_numpy().sum())),
            "rows_same_tokens_kept": float((ka == kb).mean()) if len(ka) else 1.0,
            "max_abs_adv_diff": float(da.max()) if len(da) else 0.0}


# ---------------------------------------------------------------------------------------------
# the measurement and its section
# ---------------------------------------------------------------------------------------------

def measure(root: str, recipes, memory_limit: str = "1GB", progress: str = "0", repeat: int = 1,
            workdir: str | None = None) -> dict:
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="rs-bench-cmp-")
    os.makedirs(workdir, exist_ok=True)
    info = common.describe(root)
    floor = common.best_of(lambda: run_one("floor", root, memory_limit=memory_limit), repeat)
    per = {}
    try:
        for recipe in recipes:
            rs_out = os.path.join(workdir, f"{recipe}-rollstore.parquet")
            ref_out = os.path.join(workdir, f"{recipe}-ref.parquet")
            rs = common.best_of(lambda r=recipe, o=rs_out: run_one("curate", root, r, memory_limit, progress, out=o),
                                repeat)
            dry = common.best_of(lambda r=recipe: run_one("dry", root, r, memory_limit, progress), repeat)
            copy_out = os.path.join(workdir, f"{recipe}-copy.parquet")
            copy = common.best_of(lambda o=rs_out, c=copy_out: run_one("copy", root, memory_limit=memory_limit, ids=o,
                                                                       out=c), repeat)
            ref = common.best_of(lambda r=recipe, o=ref_out: run_one("reference", root, r, memory_limit, progress,
                                                                     out=o), repeat)
            per[recipe] = {"rollstore": rs, "dry": dry, "copy": copy, "reference": ref,
                           "agreement": agreement(rs_out, ref_out)}
        growth = buffer_growth(root, info, workdir, memory_limit, progress, repeat)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"info": info, "floor": floor, "recipes": per, "growth": growth, "memory_limit": memory_limit, "progress": progress,
            "repeat": repeat}


def buffer_growth(root: str, info: dict, workdir: str, memory_limit: str, progress: str, repeat: int) -> dict:
    """d3s over the first step's batch (`where = step = 0`) in this buffer and in a buffer holding
    only that step (the same generated rows): what the rest of the buffer costs a one-step batch."""
    one = os.path.join(workdir, "one-step-buffer")
    if not os.path.exists(one):
        common.build_buffer(one, info["tokens"] // info["shards"], info["tokens"] // info["shards"])
    runs = {}
    for name, path in (("1-step buffer", one), (f"{info['shards']}-step buffer", root)):
        runs[name] = common.best_of(lambda p=path: run_one("curate", p, "d3s", memory_limit, progress,
                                                           where="step = 0"), repeat)
    return runs


def ratios(m: dict) -> dict:
    """recipe -> (× floor, × in-memory) of rollstore's time."""
    return {r: (v["rollstore"]["seconds"] / m["floor"]["seconds"], v["rollstore"]["seconds"] / v["reference"]["seconds"])
            for r, v in m["recipes"].items()}


def targets(m: dict) -> list[tuple[str, float, float]]:
    """(what, measured ratio, target) for every recipe: dry run ÷ scan floor ≤ 2, full ÷ copy floor ≤ 1.5."""
    out = []
    for r, v in m["recipes"].items():
        out.append((f"{r} --dry-run ÷ scan floor", v["dry"]["seconds"] / m["floor"]["seconds"], 2.0))
        out.append((f"{r} full curation ÷ copy floor", v["rollstore"]["seconds"] / v["copy"]["seconds"], 1.5))
        out.append((f"{r} full curation ÷ in-memory reference", v["rollstore"]["seconds"] / v["reference"]["seconds"],
                    float("nan")))
        out.append((f"{r} --dry-run ÷ in-memory reference", v["dry"]["seconds"] / v["reference"]["seconds"], 1.0))
    g = list(m["growth"].values())
    out.append((f"d3s of step 0: {list(m['growth'])[1]} ÷ 1-step buffer", g[1]["seconds"] / g[0]["seconds"], 1.5))
    return out


def tables(m: dict) -> str:
    info, floor = m["info"], m["floor"]
    tokens = info["tokens"]
    rows = [["scan floor (one DuckDB scan: same columns, \\|A\\|·H, no selection)", floor["seconds"], 1.0, None,
             tokens / floor["seconds"] / 1e6, floor["peak_rss_mib"], None, None]]
    for recipe, v in m["recipes"].items():
        rs, ref, dry, copy = v["rollstore"], v["reference"], v["dry"], v["copy"]
        rows.append([f"{recipe}: in-memory reference (numpy; load {ref['load_seconds']:.2f} s of it)", ref["seconds"],
                     ref["seconds"] / floor["seconds"], 1.0, tokens / ref["seconds"] / 1e6, ref["peak_rss_mib"],
                     ref["n_selected"], ref["tokens_kept"]])
        rows.append([f"{recipe}: copy floor (one DuckDB COPY of the selected rows' curated columns, zstd 3)",
                     copy["seconds"], copy["seconds"] / floor["seconds"], copy["seconds"] / ref["seconds"],
                     tokens / copy["seconds"] / 1e6, copy["peak_rss_mib"], rs["n_selected"], None])
        rows.append([f"**{recipe}: rollstore curate --dry-run** (record + audit, no curated shards)", dry["seconds"],
                     dry["seconds"] / floor["seconds"], dry["seconds"] / ref["seconds"], tokens / dry["seconds"] / 1e6,
                     dry["peak_rss_mib"], dry["n_selected"], dry["tokens_kept"]])
        rows.append([f"**{recipe}: rollstore curate**", rs["seconds"], rs["seconds"] / floor["seconds"],
                     rs["seconds"] / ref["seconds"], tokens / rs["seconds"] / 1e6, rs["peak_rss_mib"],
                     rs["n_selected"], rs["tokens_kept"]])
    out = [common.md_table(["run", "seconds", "× floor", "× in-memory", "Mtokens/s", "peak RSS (MiB)", "selected",
                            "tokens kept"], rows)]
    out.append("")
    out.append("Targets (issue 15), from this one run:")
    out.append("")
    out.append(common.md_table(["ratio", "measured", "target", "met"],
                               [[w, x, None if t != t else t, "-" if t != t else ("yes" if x <= t else "**no**")]
                                for w, x, t in targets(m)]))
    out.append("")
    out.append("Agreement of the in-memory reference with rollstore (selected rollouts, tokens kept per rollout, "
               "final advantages):")
    out.append("")
    agr = []
    for recipe, v in m["recipes"].items():
        a = v["agreement"]
        agr.append([recipe, f"{a['selected'][0]:,} / {a['selected'][1]:,}", a["same_rollouts"],
                    f"{a['tokens_kept'][0]:,} / {a['tokens_kept'][1]:,}", f"{100 * a['rows_same_tokens_kept']:.3f} %",
                    f"{a['max_abs_adv_diff']:.2e}"])
    out.append(common.md_table(["recipe", "selected (rollstore / ref)", "same rollouts", "tokens kept (rollstore / ref)",
                                "rows with equal tokens kept", "max \\|ΔA\\|"], agr))
    out.append("")
    out.append("Where rollstore's time goes (stage wall time inside the curate call, best run):")
    out.append("")
    names = []
    for v in m["recipes"].values():
        for k in v["rollstore"]["stages"]:
            if k not in names:
                names.append(k)
    srows = []
    for name in names:
        srows.append([name] + [v["rollstore"]["stages"].get(name) for v in m["recipes"].values()])
    srows.append(["other (snapshot, session, Python)"] + [
        v["rollstore"]["seconds"] - sum(v["rollstore"]["stages"].values()) for v in m["recipes"].values()])
    out.append(common.md_table(["stage"] + [f"{r} (s)" for r in m["recipes"]], srows))
    return "\n".join(out)


def section(m: dict, command: str | None = None, level: int = 3) -> str:
    info = m["info"]
    extra = [f"Buffer: {info['tokens']:,} response tokens, {info['rows']:,} rollouts in {info['shards']} shards, "
             f"{info['bytes'] / 2**20:.1f} MiB on disk; DuckDB memory_limit {m['memory_limit']}; progress "
             f"{m['progress']}; seconds are the best of {m['repeat']} fresh-process runs"]
    return (common.header("Curation vs scan floor and in-memory reference", command, extra, level) + "\n\n"
            + common.method(__doc__) + "\n\n" + tables(m))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--shard-tokens", type=int, default=1_000_000)
    ap.add_argument("--recipes", nargs="+", default=["d3s", "da3po"])
    ap.add_argument("--memory-limit", default="1GB")
    ap.add_argument("--progress", default="0")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--root", default=None, help="reuse (or create) this buffer")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    ap.add_argument("--child", default=None)
    ap.add_argument("--recipe-one", default="d3s")
    ap.add_argument("--where", default="true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ids", default=None, help="copy child: the selected rows (a curate child's --out)")
    ap.add_argument("--first-shards", type=int, default=0, help="reference child: only the first K shards")
    a = ap.parse_args()
    if a.child:
        common.warm_libraries()
    if a.child == "floor":
        return common.child_result(child_floor(a.root, a.memory_limit, a.where))
    if a.child in ("curate", "dry"):
        return common.child_result(child_curate(a.root, a.recipe_one, a.memory_limit, a.progress, a.where, a.out,
                                                a.profile, dry_run=a.child == "dry"))
    if a.child == "copy":
        return common.child_result(child_copy(a.root, a.memory_limit, a.ids, a.out))
    if a.child == "reference":
        return common.child_result(child_reference(a.root, a.recipe_one, a.progress, a.out, a.profile,
                                                   a.first_shards or None))
    m = common.measured_buffer(a.root, "rs-bench-", a.tokens, a.shard_tokens,
                               lambda root: measure(root, a.recipes, a.memory_limit, a.progress, a.repeat))
    common.publish(section(m), record=not a.no_record)


if __name__ == "__main__":
    main()
