"""kill -9 trials of the loop at every commit boundary, with an exactly-once checker.

Each trial: a fresh buffer; `rollstore loop` (in a forked child) is SIGKILLed right after the n-th
time it passes one kill point; the same loop is run again to its end (it resumes); then
`rollstore train BUF --run-id <the loop's run>` runs, as a user would after a crash; then the
checker reads the buffer. Kill points (each the line after a commit, or after the work a commit
would publish):

- `rollouts`: a step's rollouts shard was appended (StepWriter.generate returned);
- `curation`: the step's curation was committed (StepWriter.curate returned);
- `train`:    the learner trained the curation in memory, nothing published yet;
- `publish`:  the checkpoint (ledger, training rows, lease acks) was committed;
- `synced`:   the sampler loaded the published weights (the iteration's last line before the next).

The loop leases nothing; the lease ack is the two-process mode's (`rollstore generate --follow`
beside `rollstore train --follow`, which leases each curation and acks it in the transaction that
publishes its checkpoint). Its trials run both processes; the learner is SIGKILLed at

- `ack`:      its publish transaction acked the leases, before that transaction commits;
- `publish`:  that transaction committed;

then a new learner of the same run takes over (the dead one's leases expire: the trial sets a 2 s
TTL) and the generator finishes its steps. The same checker reads the learner's run.

The checker's violations (each trial must have none):
- `step-twice`:   two curations of one step's rows (same `where`) trained into the run;
- `row-twice`:    a rollout trained twice into the run by two curations (recipes without replay,
                  whose curations never select a stored row again);
- `left-pending`: a live curation of one of the run's steps that the run has not trained (after
                  the final `train` every committed curation was trained once, or retired);
- `late-train`:   the final `rollstore train --run-id` trained something (the loop had left a
                  curation pending for its run);
- `resume-failed`: the rerun of the loop did not finish.

Each trial is tiny (4 prompts, group size 4, 2-3 iterations, no evaluation, builtin:tiny): forked
from one process that imported everything once, it takes about a second.

    OMP_NUM_THREADS=1 python -m bench.loop_kills --trials 200 [--without-fix] [--results]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

POINTS = ("rollouts", "curation", "train", "publish", "synced")
LEASE_POINTS = ("ack", "publish")
RECIPES = ("grpo", "greso", "d3s", "replay-d3s")
REPLAYING = {"replay-d3s"}  # recipes whose curations select stored rows of earlier steps again


def loop_config(root: str, recipe: str, iterations: int):
    from rollstore.loop.driver import LoopConfig
    from rollstore.loop.generate import GenerationConfig

    return LoopConfig(buffer=root, recipe=recipe, iterations=iterations, prompts_per_iter=4, pool_size=64,
                      eval_every=0, generation=GenerationConfig(max_new_tokens=8, group_size=4))


def arm(point: str, nth: int) -> None:
    """SIGKILL this process right after the `nth` pass of `point`."""
    from rollstore.learner import consume
    from rollstore.loop import driver, step
    from rollstore.storage.manifest import Manifest

    seen = [0]

    def die_after(owner, name, inside=False):
        real = getattr(owner, name)

        def wrapped(*a, **k):
            out = real(*a, **k)
            seen[0] += 1
            if seen[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        setattr(owner, name, wrapped)

    if point == "rollouts":
        die_after(step.StepWriter, "generate")
    elif point == "curation":
        die_after(step.StepWriter, "curate")
    elif point == "train":
        die_after(consume, "train_on_curation")
    elif point == "publish":
        die_after(consume, "save_checkpoint")
    elif point == "ack":
        die_after(Manifest, "ack_paths")  # inside the publish transaction of a leasing learner
    elif point == "synced":
        real_train = driver._Run.train

        def train_then_die(self, *a, **k):
            out = real_train(self, *a, **k)
            seen[0] += 1
            if seen[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        driver._Run.train = train_then_die
    else:
        raise ValueError(point)


def in_child(fn, *args) -> tuple[str, object]:
    """Run fn(*args) in a forked child; ("killed" | "ok" | "error", its JSON result or the error)."""
    return reap(*spawn(fn, *args))


def spawn(fn, *args) -> tuple[int, int]:
    """Start fn(*args) in a forked child; (its pid, the read end of its result pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            out = {"ok": fn(*args)}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
            code = 1
        with os.fdopen(w, "w") as fh:
            fh.write(json.dumps(out, default=str))
        os._exit(code)
    os.close(w)
    return pid, r


def reap(pid: int, r: int) -> tuple[str, object]:
    """Wait for a child of `spawn`; as `in_child`."""
    with os.fdopen(r) as fh:
        text = fh.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "killed", None
    out = json.loads(text) if text else {"error": f"exit {status}"}
    return ("ok", out["ok"]) if "ok" in out else ("error", out["error"] + "\n" + out.get("trace", ""))


def _loop(root: str, recipe: str, iterations: int, point: str | None, nth: int, fixed: bool) -> int:
    from rollstore.loop.driver import run_loop

    if not fixed:
        from rollstore.loop import driver

        driver._Run.resumed_curation = lambda self, it: None  # the loop before issue 47: curate again
    if point is not None:
        arm(point, nth)
    return len(run_loop(loop_config(root, recipe, iterations))["iterations"])


def _train(root: str, run_id: str) -> int:
    from rich.console import Console

    from rollstore.rules.defaults import train_config
    from rollstore.loop.learner_loop import run_train

    import io

    return len(run_train(root, "builtin:tiny", train_config(), run_id, [], Console(file=io.StringIO())))


def _generate_follow(root: str, recipe: str, steps: int) -> int:
    """The generator of the two-process mode: `steps` steps of run `gen`, each curated."""
    import io

    from rich.console import Console

    from rollstore.loop.generate import GenerationConfig
    from rollstore.loop.generator import Follow, PromptSource, run_generate

    return len(run_generate(root, "builtin:tiny", PromptSource("builtin:arith", 4),
                            GenerationConfig(max_new_tokens=8, group_size=4), "gen", steps,
                            Console(file=io.StringIO()), follow=Follow(0, recipe)))


def _learn(root: str, point: str | None, nth: int, max_idle: float) -> int:
    """The learner of the two-process mode (run `learner`, leases of 2 s), armed at `point`."""
    import io

    from rich.console import Console

    from rollstore.rules.defaults import train_config
    from rollstore.loop.learner_loop import run_train
    from rollstore.storage.buffer import Buffer

    real = Buffer.lease
    Buffer.lease = lambda self, table, n, consumer, group="default", ttl=600.0: real(self, table, n, consumer,
                                                                                      group, 2.0)
    if point is not None:
        arm(point, nth)
    return len(run_train(root, "builtin:tiny", train_config(), "learner", [], Console(file=io.StringIO()),
                         follow=True, poll=0.1, max_idle=max_idle))


def lease_trial(recipe: str, point: str, nth: int, steps: int) -> dict:
    """One trial of the two-process mode in a fresh buffer (see the module docstring)."""
    from rollstore.storage.buffer import Buffer

    tmp = tempfile.mkdtemp(prefix="lease-kill-")
    root = os.path.join(tmp, "buf")
    try:
        Buffer.init(root).close()
        gen = spawn(_generate_follow, root, recipe, steps)
        first, _ = reap(*spawn(_learn, root, point, nth, 60.0))
        violations: list[str] = []
        second = spawn(_learn, root, None, 0, 4.0)
        state, out = reap(*gen)
        if state != "ok":
            violations.append(f"generator failed: {state} {out}")
        state, out = reap(*second)
        if state != "ok":
            violations.append(f"resume-failed: {state} {out}")
        state, late = in_child(_train, root, "learner")
        if state == "ok" and late:
            violations.append(f"late-train: {late} checkpoint(s)")
        elif state != "ok" and "nothing to train" not in str(late):
            violations.append(f"late-train failed: {late}")
        state, found = in_child(check, root, "learner", recipe in REPLAYING, "gen", steps)
        violations += found if state == "ok" else [f"check failed: {found}"]
        return {"recipe": recipe, "point": f"{point} (train --follow)", "nth": nth, "iterations": steps,
                "killed": first == "killed", "violations": violations}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check(root: str, run_id: str, replaying: bool, data_run: str | None = None,
          steps: int | None = None) -> list[str]:
    """The exactly-once violations of `run_id` in the buffer at `root` (see the module docstring);
    `data_run`: the run whose steps were curated (the loop's own; the generator's in the two-process
    mode), `steps`: how many of its steps must have been trained (the two-process mode)."""
    from rollstore.learner.checkpoint import list_checkpoints
    from rollstore.learner.consume import shard_curation_id
    from rollstore.queries.session import Session
    from rollstore.storage.buffer import Buffer

    bad: list[str] = []
    with Buffer.open(root) as buf:
        cks = list_checkpoints(buf, run_id)
        trained = {e["curation_id"] for ck in cks for e in ck.consumed}
        live_curated = {shard_curation_id(s) for s in buf.manifest.shards("curated")}
        with buf.snapshot() as snap, Session(snap) as s:
            rows = s.execute("SELECT curation_id, json_extract_string(params, '$.where') FROM curations").fetchall()
            where = dict(rows)
            prefix = f"run_id = '{data_run or run_id}' AND step = "
            by_step = collections.Counter(where.get(c) for c in trained)
            bad += [f"step-twice: {w}" for w, n in by_step.items() if n > 1]
            if steps is not None and len([w for w in by_step if w and w.startswith(prefix)]) != steps:
                bad.append(f"steps-trained: {len(by_step)} of {steps}")
            for cid, w in rows:
                if w and w.startswith(prefix) and cid not in trained and cid in live_curated:
                    bad.append(f"left-pending: {cid} ({w})")
            if trained and not replaying:
                ids = ",".join(f"'{c}'" for c in sorted(trained))
                twice = s.one(f"SELECT count(*) - count(DISTINCT rollout_id) FROM curated WHERE curation_id IN ({ids})")[0]
                if twice:
                    bad.append(f"row-twice: {twice} rollouts")
    return bad


def trial(recipe: str, point: str, nth: int, iterations: int, fixed: bool = True) -> dict:
    """One trial in a fresh buffer; its outcome and violations."""
    from rollstore.storage.buffer import Buffer

    tmp = tempfile.mkdtemp(prefix="loop-kill-")
    root = os.path.join(tmp, "buf")
    try:
        Buffer.init(root).close()
        run_id = f"loop-{recipe}-s0"
        first, _ = in_child(_loop, root, recipe, iterations, point, nth, fixed)
        violations: list[str] = []
        second, done = in_child(_loop, root, recipe, iterations, None, 0, fixed)
        if second != "ok":
            violations.append(f"resume-failed: {second} {done}")
        state, late = in_child(_train, root, run_id)
        if state == "ok" and late:
            violations.append(f"late-train: {late} checkpoint(s)")
        elif state != "ok" and "nothing to train" not in str(late):
            violations.append(f"late-train failed: {late}")
        state, found = in_child(check, root, run_id, recipe in REPLAYING)
        violations += found if state == "ok" else [f"check failed: {found}"]
        return {"recipe": recipe, "point": point, "nth": nth, "iterations": iterations, "killed": first == "killed",
                "violations": violations}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def warm() -> None:
    """Import and build once, before the forks: each trial's children start from here."""
    from rollstore.builtin.resolve import resolve_model
    from rollstore.loop import driver, step  # noqa: F401
    from rollstore.learner import consume, trainer  # noqa: F401
    from rollstore.loop import learner_loop  # noqa: F401
    from rollstore.curate import run as curate_run  # noqa: F401
    import pyarrow

    resolve_model("builtin:tiny")
    pyarrow.array([0]).to_numpy()
    driver._prompt_pool("builtin:arith", 64, 0)


def plan(trials: int, seed: int, recipes=RECIPES, points=POINTS + tuple(f"lease-{p}" for p in LEASE_POINTS)
         ) -> list[tuple[str, str, int, int]]:
    """`trials` (recipe, point, nth, iterations), every recipe × point about equally often (a
    `lease-` point: the two-process mode's trial)."""
    rng = random.Random(seed)
    cells = [(r, p) for r in recipes for p in points]
    out = []
    for i in range(trials):
        recipe, point = cells[i % len(cells)]
        iterations = rng.choice((2, 3))
        out.append((recipe, point, rng.randint(1, iterations), iterations))
    return out


def table(results: list[dict]) -> str:
    cells: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for r in results:
        cells[(r["point"], r["recipe"])].append(r)
    lines = ["| kill point | recipe | trials | killed there | violations |", "|---|---|---:|---:|---:|"]
    order = list(POINTS) + [f"{p} (train --follow)" for p in LEASE_POINTS]
    for (point, recipe), rs in sorted(cells.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        lines.append(f"| {point} | {recipe} | {len(rs)} | {sum(r['killed'] for r in rs)} | "
                     f"{sum(bool(r['violations']) for r in rs)} |")
    total = len(results)
    lines.append(f"| all | all | {total} | {sum(r['killed'] for r in results)} | "
                 f"{sum(bool(r['violations']) for r in results)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=47)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--points", default=",".join(POINTS + tuple(f"lease-{p}" for p in LEASE_POINTS)))
    ap.add_argument("--without-fix", action="store_true", help="the loop before issue 47 (curates a step again)")
    ap.add_argument("--results", action="store_true", help="append the table to bench/RESULTS.md")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warm()
    t0 = time.perf_counter()
    results = []
    for n, (recipe, point, nth, iterations) in enumerate(plan(args.trials, args.seed, args.recipes.split(","),
                                                               args.points.split(","))):
        if point.startswith("lease-"):
            r = lease_trial(recipe, point[len("lease-"):], nth, iterations)
        else:
            r = trial(recipe, point, nth, iterations, fixed=not args.without_fix)
        results.append(r)
        if r["violations"]:
            print(f"trial {n}: {recipe} {point} #{nth}/{iterations}: {r['violations']}", flush=True)
    seconds = time.perf_counter() - t0
    text = table(results)
    print(text)
    print(f"{len(results)} trials in {seconds:.0f} s")
    if args.results:
        from bench.common import append_results, header

        cmd = "OMP_NUM_THREADS=1 python -m bench.loop_kills " + " ".join(argv if argv is not None else sys.argv[1:])
        title = "Loop kill -9 trials at every commit boundary (issue 47)" + (" — the loop before the fix"
                                                                            if args.without_fix else "")
        append_results(f"{header(title, cmd, libs=('duckdb', 'pyarrow', 'torch'))}\n\n{text}\n\n"
                       f"{len(results)} trials in {seconds:.0f} s.")
    return 1 if any(r["violations"] for r in results) and not args.without_fix else 0


if __name__ == "__main__":
    sys.exit(main())
