"""A long run, built synthetically: each per-step cost and each user command as the history grows.

No model generates anything: each step draws its prompts with greso pre-rollout selection
(`curate.prompts.state` / `select`, as the loop does), makes `--groups` × 8 synthetic rollouts of
those prompts (`builtin.synthetic`), appends them with the step's selection decisions in one commit
(`append_rollouts`, as the loop's `StepWriter`), curates the step (d3s with `prompt_skip=greso`,
committed, through one session reused as the loop reuses it), does the learner's bookkeeping of one
unit (the pending shards against the run's ledger, the newest version, the publish check) and
publishes one checkpoint of a tiny Llama (`save_checkpoint`, real safetensors, K = `--keep`). Each
of these is timed (CPU and wall seconds, median of the `--window` steps before each point), all in
this one process; the learner's bookkeeping is also timed along main 37bb4b9's path (copied below:
every checkpoint row read from its file through a 4,096-entry cache, four listings a step), side by
side on the same buffer, in the steps whose medians a point reports (it grows with the history).
The pool is `POOL` prompts, each with its own success rate, fixed for the run (a Beta(0.6, 0.6) draw:
some prompts nearly always solved, some nearly never, many between), so that greso's skipping reaches
a steady state within a few passes of the pool, as on a real task whose difficulty persists. (Rates
drawn afresh at every visit, as the first version of this bench did, make zero-variance groups
unpredictable: greso's exploration rate then falls to its floor and it examines ever more prompts a
step, 64 → 4,054 by 5,000 steps, which measures the data, not the store.) The number of prompts
greso examines is reported, and both costs per prompt examined.

As the loop does (`--compact-every`, default 100 as the loop's), the run's small shards are merged every N
steps (`rollstore.loop.driver.compact_history`), timed apart from the steps and reported per step;
it runs after the step that follows each multiple of N, so each point (a multiple) meets the N − 1
newest steps not yet merged, the most a loop's buffer holds.

At each point the loop's peak resident set over its steps since the last point is reported (the
commands' apart), and a resumed process's first step: the buffer and the session opened afresh,
every per-process cache emptied, one step — against the median warm step.

At each point of `--at` the user commands run in this process through the CLI (`report`, `audit`,
`info`, `curate --dry-run`, a full `verify`, then one more step and `verify --incremental`).
After the last point the rollouts and selections shards are compacted and `gc --grace 0` retires
the merged shards, in one transaction (this code) and one per shard (main's loop, on a copy of the
same buffer); `verify`'s reference check runs with each compacted shard read once (this code) and
once per curated shard (main's path); then `--after` more steps and the commands again.

`--cliff N` instead publishes N checkpoints (tiny model, K = 3) and lists them at growing counts,
main's file-reading path against the catalog index: main's cache held 4,096 files.

    python -m bench.longrun --at 50,200,500
    python -m bench.longrun --full            # 50, 200, 500, 2,000 and 5,000 steps (the issue's scale)
    python -m bench.longrun --cliff 4300
    python -m bench.longrun --versus /tmp/a,/tmp/b --base 50 --rounds 20   # histories left by --work runs
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections import namedtuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

RUN = "longrun"
GROUP_SIZE = 8
POOL = 512  # prompts in the pool (8 steps a pass at 64 a step); greso reads the history of all of them a step
Prompt = namedtuple("Prompt", "prompt_id prompt")
MAIN_LIST = "list (main's path)"
EXAMINED = "prompts greso examined (count)"  # one prompt_selections row each, appended with the step
MAIN_KEYS = ("learner bookkeeping, main's path", EXAMINED)  # not part of this code's step time


def timed(fn):
    """(fn(), CPU seconds, wall seconds)."""
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.process_time() - c, time.perf_counter() - t


# ---- main 37bb4b9's checkpoint bookkeeping, copied (the path this issue replaced) -----------------

@functools.lru_cache(maxsize=4096)
def _main_rows_of_file(path: str, size: int, mtime_ns: int, inode: int) -> tuple:
    import pyarrow.parquet as pq

    from rollstore.storage.schema import CHECKPOINTS

    return tuple(pq.read_table(path, columns=CHECKPOINTS.names).to_pylist())


def _main_rows(files) -> list[dict]:
    rows = []
    for f in files:
        st = os.stat(f)
        rows.extend(dict(r) for r in _main_rows_of_file(f, st.st_size, st.st_mtime_ns, st.st_ino))
    return rows


def main_list(buf, run_id=None) -> list[dict]:
    """main's `list_checkpoints`: a snapshot, then every checkpoint shard's row from its file."""
    rows = _main_rows(buf.snapshot().files("checkpoints"))
    return sorted((r for r in rows if run_id is None or r["run_id"] == run_id), key=lambda r: r["version"])


def main_bookkeeping(buf, version: int, curation_id: str) -> None:
    """main's learner bookkeeping of one unit: `_pending_units` (is `version` published? its ledger),
    the new version (`latest_checkpoint`) and the publish check (`_live_checkpoint_rows`)."""
    from rollstore.learner.consume import pending_shards

    if any(r["version"] == version for r in main_list(buf)):
        by = {r["version"]: r for r in main_list(buf)}
        ledger, v = [], version
        while v in by:
            ledger = json.loads(by[v]["consumed"]) + ledger
            v = by[v]["parent_version"]
    else:
        ledger = []
    pending_shards(buf, ledger, [curation_id])
    main_list(buf)[-1:]
    _main_rows([os.path.join(buf.root, p) for _i, p in buf.manifest.live_paths("checkpoints")])


def new_bookkeeping(buf, version: int, curation_id: str) -> None:
    """The same bookkeeping on this code (`learner.consume._pending_units` less its file checks, the new
    version, the publish's checks): by the catalog's checkpoint index and ledger table."""
    from rollstore.learner.checkpoint import checkpoint_rows, consumed_in_lineage, get_checkpoint, latest_checkpoint
    from rollstore.learner.consume import _curated, pending_shards

    pool = _curated(buf, [curation_id])
    done = consumed_in_lineage(buf, version, [s.path for s in pool]) if get_checkpoint(buf, version) else set()
    pending_shards(buf, [{"shard": s} for s in done], [curation_id], pool)
    latest_checkpoint(buf)
    checkpoint_rows(buf, version=version + 1)
    buf.manifest.consumed_by([s.path for s in pool], RUN)


def main_gc_retired(buf) -> int:
    """main's retirement loop of `gc`: one fsync'd transaction per retired shard."""
    man = buf.manifest
    rows = man.con.execute("SELECT shard_id, path, removed_seq FROM shards WHERE removed_seq IS NOT NULL").fetchall()
    for shard_id, path, removed_seq in rows:
        with man.transaction() as con:
            con.execute("DELETE FROM shards WHERE shard_id = ?", (shard_id,))
            con.execute("INSERT INTO meta VALUES ('collected_seq', ?) ON CONFLICT (key) DO UPDATE "
                        "SET value = max(CAST(value AS INTEGER), CAST(excluded.value AS INTEGER))", (str(removed_seq),))
        try:
            os.unlink(os.path.join(buf.root, path))
        except FileNotFoundError:
            pass
    return len(rows)


def main_scan_references(root, man) -> list[str]:
    """main's `scan_references`: each curated shard's references read the rows they name, shard by shard."""
    from rollstore.storage.references import check_references, read_references
    from rollstore.storage.verify import check_shard

    live = [s.path for s in man.shards("rollouts")]
    moves = man.moves()
    problems = []
    for shard in man.shards("curated"):
        path = os.path.join(root, shard.path)
        if check_shard(root, shard, full=False) is not None:
            continue
        for refs in read_references([path]):
            problem = check_references(root, refs, live, path, moves)
            if problem is not None:
                problems.append(problem)
    return problems


# ---- the synthetic run ----------------------------------------------------------------------------

class History:
    """One synthetic run in `root`: `step()` does one loop step and returns its timings."""

    def __init__(self, root: str, groups: int, keep: int, mean_tokens: int, existing: bool = False,
                 compact_every: int = 0):
        import torch

        from rollstore.curate.params import load_recipe, resolve
        from rollstore.curate.prompts import prompt_plan
        from rollstore.queries.session import Session
        from rollstore.storage.buffer import Buffer

        torch.set_num_threads(1)
        self.buf = Buffer.open(root) if existing else Buffer.init(root)
        self.root, self.groups, self.keep, self.mean_tokens = root, groups, keep, mean_tokens
        self.recipe = load_recipe("d3s")
        self.sets = {"prompt_skip": "greso"}
        self.params = resolve(self.recipe, self.sets)
        self.plan = prompt_plan(self.params)  # greso's own plan (the loop's `skipping`)
        self.session = Session(self.buf.snapshot(), threads=1, long_lived=True)  # as the loop's
        self.model = _tiny_model()
        self.version, self.steps, self.position = 0, 0, 0
        self.compact_every = compact_every  # as the loop's `compact_every` (rollstore.loop.driver.compact_history)
        self.compaction = [0.0, 0.0]  # its CPU and wall seconds so far
        self.merged: set[int] = set()  # as the loop's: the shards its compactions wrote (`compact_history`)
        if existing:  # a history this bench built (`--reopen`): one checkpoint a step, from version 0
            from rollstore.learner.checkpoint import latest_checkpoint

            self.version = self.steps = latest_checkpoint(self.buf, RUN).version

    def close(self) -> None:
        self.session.close()
        self.buf.close()

    def forget(self) -> None:
        """As a killed process: the buffer and the session closed, every cache this process keeps
        between steps emptied (file hashes, footers, checkpoint rows, columns). Not a resumed process's
        cost: `resume` is."""
        self.close()
        _clear_process_caches()

    def resume(self) -> None:
        """As a resumed process starts (after `forget`): the buffer and the session opened afresh."""
        from rollstore.queries.session import Session
        from rollstore.storage.buffer import Buffer

        self.buf = Buffer.open(self.root)
        self.session = Session(self.buf.snapshot(), threads=1, long_lived=True)

    def step(self, total: int, main_path: bool = True) -> dict:
        from rollstore.curate.params import step_where
        from rollstore.curate.prompts import select, state
        from rollstore.curate.run import curate
        from rollstore.learner.checkpoint import Publish, consumed_entry, save_checkpoint

        s = self.steps
        out: dict[str, tuple[float, float]] = {}

        def stream(pos: int) -> Prompt:
            return Prompt(f"p{pos % POOL}", f"prompt {pos % POOL}")

        def selection():
            now = state(self.session, RUN, s, self.plan)
            start = self.position if now.last_position is None else now.last_position + 1
            return select(self.session, self.plan, run_id=RUN, step=s, seed=0, stream=stream, start=start,
                          need=self.groups, limit=POOL, rates=now.rates)

        sel, *out["greso selection"] = timed(selection)
        self.position = sel.next_position
        table = _rollouts(s, self.version, [p.prompt_id for p in sel.chosen], self.mean_tokens)
        selections = sel.table()
        _, *out["append"] = timed(lambda: self.buf.append_rollouts(table, source=f"longrun-{s}",
                                                                   also={"prompt_selections": selections}))
        out[EXAMINED] = (selections.num_rows, selections.num_rows)  # (a count: the work greso and append scale with)
        cur, *out["curation of the newest step"] = timed(lambda: curate(
            self.buf, self.recipe, {**self.sets, "where": step_where(RUN, s), "progress": f"{min(1.0, s / total):.6f}"},
            session=self.session))
        _, *out["learner bookkeeping"] = timed(lambda: new_bookkeeping(self.buf, self.version, cur.curation_id))
        if main_path:  # (only in the steps a point's medians take: main's path grows with the history)
            _, *out["learner bookkeeping, main's path"] = timed(
                lambda: main_bookkeeping(self.buf, self.version, cur.curation_id))
        shards = [sh for sh in self.buf.manifest.shards("curated") if sh.key == cur.curation_id]
        publish = Publish(self.version + 1, RUN, [consumed_entry(cur.curation_id, sh.path) for sh in shards],
                          parent_version=self.version, step=s + 1, metrics={"iteration": s},
                          retention=(self.keep, 0))
        _, *out["checkpoint save"] = timed(lambda: save_checkpoint(self.buf, self.model, publish=publish))
        self.version += 1
        self.steps += 1
        # (after the step that follows each multiple of N: a point, at a multiple, meets N - 1 steps not yet
        # merged, the most a loop's buffer holds; timed apart from the step's costs, amortised)
        if self.compact_every and self.steps % self.compact_every == 1 % self.compact_every:
            from rollstore.loop.driver import compact_history

            _, cpu, wall = timed(lambda: compact_history(self.buf, self.merged))
            self.compaction = [self.compaction[0] + cpu, self.compaction[1] + wall]
        return out


def _clear_process_caches() -> None:
    """Empty what a rollstore process keeps between a loop's steps: every lru_cache of its modules and
    the module-level caches of file hashes, decoded columns, moves and checkpoint rows."""
    import sys

    from rollstore.curate import steps
    from rollstore.storage import references, shard_schemas, snapshot, verify

    for name, module in list(sys.modules.items()):
        if name.startswith("rollstore") or name.split(".")[0] in ("storage", "curate", "queries", "learner"):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()
    verify._verified.clear()
    references._columns.clear()
    references._moves_seen.clear()
    steps._CHECKPOINT_RUNS.clear()
    shard_schemas.forget()
    snapshot._SCHEMAS.clear()
    _main_rows_of_file.cache_clear()


def _tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=40, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


@functools.lru_cache(maxsize=1)
def _success_rates():
    """Each pool prompt's success rate, fixed for the run."""
    import numpy as np

    return np.random.default_rng(7).beta(0.6, 0.6, size=POOL)


def _rollouts(step: int, version: int, prompt_ids: list[str], mean_tokens: int):
    """`len(prompt_ids)` groups of GROUP_SIZE synthetic rollouts of step `step`, one group per prompt,
    each rollout correct with its prompt's own success rate."""
    import numpy as np
    import pyarrow as pa

    from rollstore.builtin.synthetic import rollouts_table

    t = rollouts_table(n_groups=len(prompt_ids), group_size=GROUP_SIZE, mean_tokens=mean_tokens, seed=step,
                       run_id=RUN, step=step, policy_version=version, n_prompts=len(prompt_ids))
    ids = [p for p in prompt_ids for _ in range(GROUP_SIZE)]
    rates = _success_rates()[[int(p[1:]) for p in ids]]
    correct = np.random.default_rng([7, step]).random(len(ids)) < rates
    t = t.set_column(t.schema.get_field_index("reward"), "reward", pa.array(correct.astype(np.float32)))
    t = t.set_column(t.schema.get_field_index("correct"), "correct", pa.array(correct))
    t = t.set_column(t.schema.get_field_index("prompt_id"), "prompt_id", pa.array(ids))
    return t.set_column(t.schema.get_field_index("prompt"), "prompt", pa.array([f"prompt {p[1:]}" for p in ids]))


# ---- user commands ----------------------------------------------------------------------------------

def commands(h: History, work: str) -> dict[str, tuple[float, float]]:
    """Each user command once, in this process through the CLI (CPU s, wall s); `verify --incremental`
    after one more step (which is not counted in the per-step medians)."""
    from typer.testing import CliRunner

    from rollstore.cli import app

    runner = CliRunner()

    def cli(*args):
        res = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
        if res.exit_code != 0:
            raise SystemExit(f"rollstore {' '.join(map(str, args))}: {res.stderr.strip()[-500:]}")

    root = h.root
    out = {}
    for name, args in (("report", ("report", root, "--out", os.path.join(work, "report.html"))),
                       ("audit", ("audit", root)), ("info", ("info", root)),
                       ("curate --dry-run (newest step)", ("curate", root, "-r", "d3s", "--dry-run")),
                       ("verify (full)", ("verify", root))):
        _, *out[name] = timed(lambda: cli(*args))
    h.step(10 ** 9)
    _, *out["verify --incremental (one more step)"] = timed(lambda: cli("verify", root, "--incremental"))
    return out


def medians(steps: list[dict]) -> dict[str, tuple[float, float]]:
    return {k: (statistics.median(s[k][0] for s in steps), statistics.median(s[k][1] for s in steps))
            for k in steps[0]}


def disk(root: str) -> dict:
    """Checkpoint folders on disk and the manifest file's bytes (its WAL, transient, left out)."""
    ck = os.path.join(root, "checkpoints")
    return {"checkpoint folders": len(os.listdir(ck)) if os.path.isdir(ck) else 0,
            "manifest bytes": os.path.getsize(os.path.join(root, "manifest.sqlite"))}


# ---- the run ----------------------------------------------------------------------------------------

def longrun(points: list[int], groups: int, keep: int, window: int, after: int, mean_tokens: int,
            work: str, compact_after: bool = True, compact_every: int = 0) -> dict:
    from bench import common
    from rollstore.learner.checkpoint import list_checkpoints
    from rollstore.storage.maintenance import compact, gc
    from rollstore.storage.verify import scan_references

    common.warm_libraries()
    root = os.path.join(work, "buf")
    h = History(root, groups, keep, mean_tokens, compact_every=compact_every)
    total = points[-1]
    results: dict = {"points": {}, "rows_per_step": groups * GROUP_SIZE}
    recent: list[dict] = []
    started = time.perf_counter()
    try:
        for n in points:
            common.reset_peak_rss()  # the loop's own peak over the steps since the last point (no command)
            since, compacted = h.steps, list(h.compaction)
            while h.steps < n:
                recent = (recent + [h.step(total, main_path=n - h.steps <= window)])[-window:]
            loop_rss = common.peak_rss_mib()
            at = {"per step": medians(recent), "commands": commands(h, work)}
            warm = statistics.median(sum(c for k, (c, _w) in r.items() if k not in MAIN_KEYS) for r in recent)
            h.forget()
            _, resume_cpu, _ = timed(h.resume)
            first = h.step(total, main_path=False)
            at["resumed process's first step"] = (
                resume_cpu + sum(c for k, (c, _w) in first.items() if k not in MAIN_KEYS), warm)
            at["loop peak RSS MiB"] = loop_rss
            at["compaction per step"] = tuple((h.compaction[i] - compacted[i]) / max(1, n - since) for i in (0, 1))
            _, *at["list checkpoints (index)"] = timed(lambda: list_checkpoints(h.buf))
            _, *at["list checkpoints (main's path)"] = timed(lambda: main_list(h.buf))
            rollouts = h.buf.manifest.con.execute(
                "SELECT coalesce(sum(rows), 0) FROM shards WHERE table_name = 'rollouts' AND removed_seq IS NULL"
            ).fetchone()[0]
            at.update(disk(root), rollouts=int(rollouts), peak_rss_mib=common.peak_rss_mib(),
                      elapsed_s=time.perf_counter() - started)
            at["manifest bytes per rollout"] = at["manifest bytes"] / max(1, at["rollouts"])
            results["points"][n] = at
            print(json.dumps({"steps": n, "elapsed_s": round(at["elapsed_s"], 1)}), flush=True)
        if compact_after:
            results["after compact"] = after_compaction(h, work, total, after)
    finally:
        h.close()
    return results


def after_compaction(h: "History", work: str, total: int, after: int) -> dict:
    """Compaction of rollouts, prompt selections' and audits' shards, gc (this code vs main's loop on a
    copy), verify's references (this code vs main's), then `after` more steps and the commands."""
    from bench import common
    from rollstore.storage.buffer import Buffer
    from rollstore.storage.maintenance import compact, gc
    from rollstore.storage.verify import scan_references

    root = h.root
    post: dict = {}
    reports, *post["compact (rollouts + selections + audits)"] = timed(
        lambda: [compact(h.buf, t) for t in ("rollouts", "prompt_selections", "selections")])
    post["shards merged"] = sum(r.merged_shards for r in reports)
    h.session.rebind(h.buf.snapshot())  # as the loop's next curation does: its pin moves past the compaction
    copy = os.path.join(work, "copy")
    shutil.copytree(root, copy)
    with Buffer.open(copy) as old:
        _n_old, *post["gc retirement, main's loop (one transaction a shard)"] = timed(lambda: main_gc_retired(old))
    shutil.rmtree(copy)
    rep, *post["gc --grace 0 (this code)"] = timed(lambda: gc(h.buf, 0))
    post["shards retired"] = rep.retired_removed
    _, *post["verify references (this code)"] = timed(lambda: scan_references(root, h.buf.manifest))
    _, *post["verify references (main's path)"] = timed(lambda: main_scan_references(root, h.buf.manifest))
    recent = [h.step(total) for _ in range(after)]
    post["per step"] = medians(recent[1:] if len(recent) > 2 else recent)
    post["commands"] = commands(h, work)
    post.update(disk(root), peak_rss_mib=common.peak_rss_mib())
    return post


def versus(histories: list[str], base: int, rounds: int, groups: int, keep: int, mean_tokens: int,
           work: str) -> dict:
    """Side by side in one process, step by step: a fresh history of `base` steps and each history an
    earlier run of this bench left (`histories`: their --work folders), one step of each in turn for
    `rounds` rounds (the first left out: a reopened history's first step pays its opening); the
    median of each per-step cost per history. A machine whose load drifts during a long run inflates
    one point's 5-step median; alternating the histories step by step exposes them to the same load."""
    from bench import common

    common.warm_libraries()
    fresh = History(os.path.join(work, "buf"), groups, keep, mean_tokens)
    for _ in range(base):
        fresh.step(10 ** 9, main_path=False)
    hs = [(f"{base:,} steps (fresh)", fresh)]
    for folder in histories:
        h = History(os.path.join(folder, "buf"), groups, keep, mean_tokens, existing=True)
        hs.append((f"{h.steps:,} steps ({os.path.basename(os.path.dirname(os.path.abspath(folder)))})", h))
    taken: dict[str, list[dict]] = {name: [] for name, _ in hs}
    try:
        for _ in range(rounds + 1):
            for name, h in hs:
                taken[name].append(h.step(10 ** 9, main_path=False))
    finally:
        for _, h in hs:
            h.close()
    return {name: medians(steps[1:]) for name, steps in taken.items()}


def versus_report(out: dict, command: str) -> str:
    from bench import common

    names = list(out)
    first = names[0]
    rows = []
    for k in out[first]:
        fmt = "{:.0f}" if k == EXAMINED else "{:.4f} / {:.4f}"
        rows.append([k] + [fmt.format(*out[n][k]) for n in names]
                    + [f"{out[n][k][0] / max(1e-9, out[first][k][0]):.2f}×" for n in names[1:]])
    head = (["per step (CPU s / wall s, median)"] + names + [f"CPU {n.split(' (')[0]} ÷ {first.split(' (')[0]}"
                                                            for n in names[1:]])
    return (common.header("Per-step costs, histories side by side, step by step (bench/longrun.py --versus)",
                          command, ["one step of each history in turn; medians over the rounds after the first"],
                          libs=("duckdb", "pyarrow", "torch"))
            + "\n\n" + common.md_table(head, rows) + "\n")


def reopen(work: str, groups: int, keep: int, mean_tokens: int, after: int) -> dict:
    """The commands, then compaction and the steps and commands after it, on a history an earlier run
    of this bench left in `work` (`--work`): a later code's commands on the same buffer."""
    from bench import common

    common.warm_libraries()
    h = History(os.path.join(work, "buf"), groups, keep, mean_tokens, existing=True)
    try:
        out = {"steps": h.steps, "commands": commands(h, work)}
        out["after compact"] = after_compaction(h, work, 10 ** 9, after)
    finally:
        h.close()
    return out


def reopen_report(out: dict, command: str) -> str:
    from bench import common

    post = out["after compact"]
    rows = [[k, "{:.2f} / {:.2f}".format(*out["commands"][k]), "{:.2f} / {:.2f}".format(*post["commands"][k])]
            for k in out["commands"]]
    t1 = common.md_table(["command (CPU s / wall s)", f"{out['steps']:,} steps", "compacted"], rows)
    rows = [[k, "{:.2f} / {:.2f}".format(*v)] for k, v in post.items() if isinstance(v, list) and len(v) == 2]
    t2 = common.md_table(["maintenance (CPU s / wall s)", "seconds"], rows)
    rows = [[k, "{:.4f} / {:.4f}".format(*v)] for k, v in post["per step"].items()]
    t3 = common.md_table(["per step after compaction (CPU s / wall s, median)", "seconds"], rows)
    extra = [f"{post['shards merged']} shards merged, {post['shards retired']} retired by gc"]
    return (common.header("A long run's buffer reopened: commands and compaction (bench/longrun.py --reopen)",
                          command, extra, libs=("duckdb", "pyarrow", "torch"))
            + "\n\n" + t1 + "\n\n" + t2 + "\n\n" + t3 + "\n")


def cliff(n: int, counts: list[int], work: str) -> dict:
    """Publish `n` checkpoints (K = 3); at each of `counts`, list them by the index and by main's path."""
    from rollstore.learner.checkpoint import Publish, latest_checkpoint, list_checkpoints, save_checkpoint
    from rollstore.storage.buffer import Buffer

    model = _tiny_model()
    root = os.path.join(work, "cliff")
    out = {}
    with Buffer.init(root) as buf:
        for v in range(1, n + 1):
            save_checkpoint(buf, model, publish=Publish(v, RUN, [], parent_version=v - 1, step=v, retention=(3, 0)))
            if v in counts:
                main_list(buf)  # main's cache warmed once, as a loop's every-step listing keeps it
                row = {}
                _, *row["list (index)"] = timed(lambda: list_checkpoints(buf))
                _, *row["latest (index)"] = timed(lambda: latest_checkpoint(buf, RUN))
                _, *row[MAIN_LIST] = timed(lambda: main_list(buf))
                row["folders"] = len(os.listdir(os.path.join(root, "checkpoints")))
                out[v] = row
                print(json.dumps({"checkpoints": v, **{k: v2 for k, v2 in row.items()}}), flush=True)
    return out


def report(results: dict, args, command: str) -> str:
    from bench import common

    pts = results["points"]
    ns = list(pts)
    first = ns[0]
    keys = list(pts[first]["per step"])
    rows = []
    post = results.get("after compact")  # (none with --no-compact: "—")
    post_steps = post["per step"] if post else None

    def per_examined(step: dict) -> dict:  # greso's and append's cost per prompt examined (ms; CPU / wall)
        n = max(1.0, step[EXAMINED][0])
        return {f"{k} per prompt examined (ms)": (1e3 * step[k][0] / n, 1e3 * step[k][1] / n)
                for k in ("greso selection", "append")}

    for k in keys + list(per_examined(pts[first]["per step"])):
        cells = [k]
        values = [pts[n]["per step"][k] if k in keys else per_examined(pts[n]["per step"])[k] for n in ns]
        fmt = "{:.0f}" if k == EXAMINED else "{:.4f} / {:.4f}"
        cells += [fmt.format(*v) for v in values]
        cells.append("—" if not post else fmt.format(*(post_steps[k] if k in keys else per_examined(post_steps)[k])))
        cells.append(f"{values[-1][0] / max(1e-9, values[0][0]):.2f}×")
        rows.append(cells)
    head = ["per step (CPU s / wall s, median)"] + [f"{n:,} steps" for n in ns] + [f"{ns[-1]:,}, compacted",
                                                                                 f"CPU {ns[-1]:,} ÷ {first}"]
    t1 = common.md_table(head, rows)
    crow = []
    for k in pts[first]["commands"]:
        cells = [k] + [f"{pts[n]['commands'][k][0]:.2f} / {pts[n]['commands'][k][1]:.2f}" for n in ns]
        crow.append(cells + ["{0:.2f} / {1:.2f}".format(*post["commands"][k]) if post else "—"])
    for k in ("list checkpoints (index)", "list checkpoints (main's path)"):
        crow.append([k] + [f"{pts[n][k][0]:.3f} / {pts[n][k][1]:.3f}" for n in ns] + [""])
    t2 = common.md_table(["command (CPU s / wall s)"] + [f"{n:,} steps" for n in ns] + [f"{ns[-1]:,}, compacted"], crow)
    prow = [[k, f"{v[0]:.2f} / {v[1]:.2f}"] for k, v in (post or {}).items() if isinstance(v, list) and len(v) == 2]
    t3 = common.md_table(["maintenance after the last point (CPU s / wall s)", "seconds"], prow) if post else \
        "(not compacted: --no-compact)"
    def resumed(n) -> str:
        first, warm = pts[n]["resumed process's first step"]
        return f"{first:.3f} / {warm:.3f} = {first / max(1e-9, warm):.2f}×"

    drow = [[f"{n:,}", pts[n]["rollouts"], pts[n]["checkpoint folders"], f"{pts[n]['manifest bytes per rollout']:.0f}",
             f"{pts[n]['loop peak RSS MiB']:.0f}", f"{pts[n]['peak_rss_mib']:.0f}", resumed(n),
             "{0:.4f} / {1:.4f}".format(*pts[n].get("compaction per step", (0.0, 0.0))),
             f"{pts[n]['elapsed_s']:.0f}"] for n in ns]
    t4 = common.md_table(["steps", "rollouts", "checkpoint folders on disk", "manifest bytes / rollout",
                          "loop's peak RSS MiB (its steps since the last point)", "peak RSS MiB (with the commands)",
                          "resumed process's first step ÷ a warm step (CPU s)",
                          f"the loop's compaction (every {args.compact_every} steps) per step since the last point, "
                          "CPU s / wall s", "elapsed s"], drow)
    extra = [f"{results['rows_per_step']} rows a step ({args.groups} greso-selected prompts × {GROUP_SIZE}), mean "
             f"{args.mean_tokens} response tokens; K = {args.keep}; medians of the {args.window} steps before each point; "
             + (f"{post['shards merged']} shards merged, {post['shards retired']} retired by gc" if post else "not compacted")]
    return (common.header("A long run, synthetic, side by side in one process (bench/longrun.py)", command, extra,
                          libs=("duckdb", "pyarrow", "torch"))
            + "\n\n" + t1 + "\n\n" + t2 + "\n\n" + t3 + "\n\n" + t4 + "\n")


def cliff_report(out: dict, command: str) -> str:
    from bench import common

    rows = [[f"{v:,}", f"{r['list (index)'][0]:.3f} / {r['list (index)'][1]:.3f}",
             f"{r['latest (index)'][0]:.4f} / {r['latest (index)'][1]:.4f}",
             "{0:.3f} / {1:.3f}".format(*r[MAIN_LIST]),
             r["folders"]] for v, r in out.items()]
    return (common.header("Checkpoint listing past 4,096 checkpoints (bench/longrun.py --cliff)", command,
                          ["K = 3; main's path: a snapshot, then each checkpoint row from its file through a "
                           "4,096-entry cache (warmed by one listing before the timed one)"],
                          libs=("duckdb", "pyarrow", "torch"))
            + "\n\n" + common.md_table(["checkpoints", "list_checkpoints, index (CPU / wall s)",
                                        "latest_checkpoint, index", "listing, main's path", "folders on disk"], rows)
            + "\n")


def main() -> None:
    import sys

    sys.path.insert(0, ROOT)
    from bench import common

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--at", default="50,200,500", help="history sizes (steps) to measure at")
    ap.add_argument("--full", action="store_true", help="the issue's scale: --at 50,200,500,2000,5000")
    ap.add_argument("--groups", type=int, default=64, help="prompts a step (× 8 rollouts)")
    ap.add_argument("--mean-tokens", type=int, default=32)
    ap.add_argument("--keep", type=int, default=3, help="K: checkpoints that keep their files")
    ap.add_argument("--window", type=int, default=5, help="steps whose median each point reports")
    ap.add_argument("--after", type=int, default=5, help="steps after compaction")
    ap.add_argument("--cliff", type=int, default=0, help="instead: publish this many checkpoints and list them")
    ap.add_argument("--reopen", action="store_true", help="instead: the commands and compaction on the history "
                    "an earlier run left in --work")
    ap.add_argument("--compact-every", type=int, default=100, help="as the loop's --compact-every: the run's small "
                    "shards merged every N steps, timed apart from the steps (0: never)")
    ap.add_argument("--no-compact", action="store_true", help="stop at the last point, the history left "
                    "uncompacted (for a later code's `--reopen` on the same buffer, with --work)")
    ap.add_argument("--versus", default="", help="instead: the --work folders of earlier runs (comma-separated), "
                    "each stepped in turn beside a fresh history of --base steps, --rounds rounds")
    ap.add_argument("--base", type=int, default=50, help="--versus: the fresh history's steps")
    ap.add_argument("--rounds", type=int, default=20, help="--versus: the rounds (one step of each history)")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--work", help="the working folder (default: a temporary one, removed)")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="rs-bench-longrun-")
    os.makedirs(work, exist_ok=True)
    command = common.command_line()
    try:
        if a.reopen:
            if not a.work:
                raise SystemExit("--reopen needs --work, the folder of an earlier run")
            out = reopen(work, a.groups, a.keep, a.mean_tokens, a.after)
            common.publish(reopen_report(out, command), record=not a.no_record)
            return
        if a.versus:
            out = versus(a.versus.split(","), a.base, a.rounds, a.groups, a.keep, a.mean_tokens, work)
            common.publish(versus_report(out, command), record=not a.no_record)
            return
        if a.cliff:
            counts = sorted({c for c in (1000, 2000, 4000, 4096, 4200, a.cliff) if c <= a.cliff})
            common.publish(cliff_report(cliff(a.cliff, counts, work), command), record=not a.no_record)
            return
        points = [50, 200, 500, 2000, 5000] if a.full else [int(x) for x in a.at.split(",")]
        results = longrun(points, a.groups, a.keep, a.window, a.after, a.mean_tokens, work, not a.no_compact,
                          a.compact_every)
        common.publish(report(results, a, command), record=not a.no_record)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
