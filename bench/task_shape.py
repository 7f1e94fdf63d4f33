"""Does a built-in task have the shape the seeds' recipes assume? Measured over a real loop's buffer.

For each task it runs the near-on-policy loop (tuned grpo by default: μ 4, lr 2e-4, 64 prompts × 8 from
a pool of 256, 24 iterations) — or reads a buffer such a loop already wrote (`--buffer TASK=PATH`) —
and answers, with SQL over the stored rollouts:

- response length (mean tokens, end-of-sequence included);
- entropy concentration: the share of all response-token entropy held by the top 20 % of tokens,
  and the share of tokens below 0.05 nats (the 80/20 study, arXiv 2506.01939: over half of a
  Qwen3-8B chain of thought's tokens below 0.01 nats, the 80th percentile at 0.672);
- the share of zero-variance groups (all right or all wrong) per step;
- persistence: of the groups that were all-correct (or all-wrong) at a prompt's visit, the share
  that are so again at its next visit (GRESO, arXiv 2506.02177, builds on this: prompts uninformative
  in one epoch are likely to stay so).

"At the warm start" is step 0 (sampled by v0) for the token figures and the first → second visit for
persistence; "after" is the run's last pool epoch (its last 4 steps) and the last → second-to-last
visit. Invariants: every figure is a query over the buffer's `rollouts` and `groups`; nothing is
estimated in Python beyond the quantile of one step's entropies.

Usage: python -m bench.task_shape [--tasks chains carries arith] [--out bench/learning/shape.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

from bench.common import append_results, header, md_table  # noqa: E402

TASKS = {"arith": ("builtin:arith", "builtin:tiny"), "carries": ("builtin:carries", "builtin:tiny-carries"),
         "chains": ("builtin:chains", "builtin:tiny-chains")}


def run(task: str, root: str, seed: int, iterations: int, epochs: int, lr: float) -> str:
    """A tuned-grpo loop on `task` into a fresh buffer `root`."""
    import shutil

    from rollstore.learner.config import TrainConfig
    from rollstore.loop import LoopConfig, run_loop
    from rollstore.loop.generate import GenerationConfig
    from rollstore.builtin.resolve import task_max_new_tokens
    from rollstore.storage.buffer import Buffer

    prompts, model = TASKS[task]
    shutil.rmtree(root, ignore_errors=True)
    Buffer.init(root).close()
    cfg = LoopConfig(buffer=root, model=model, prompts=prompts, recipe="grpo", iterations=iterations,
                     prompts_per_iter=64, pool_size=256, seed=seed, run_id=f"shape-{task}", eval_every=0,
                     generation=GenerationConfig(group_size=8, max_new_tokens=task_max_new_tokens(prompts)),
                     train=TrainConfig(lr=lr, micro_batch_size=512, warmup_steps=5), epochs=epochs, lr=lr)
    run_loop(cfg)
    return root


def measure(root: str) -> dict:
    """The shape figures of one loop buffer (module docstring)."""
    import numpy as np

    import rollstore as rs

    buf = rs.open(root)
    steps = buf.sql("SELECT max(step) AS s FROM rollouts").pl()["s"][0]
    last = list(range(max(0, steps - 3), steps + 1))

    def tokens(step_list: list[int]) -> dict:
        sl = ",".join(str(s) for s in step_list)
        frame = buf.sql(f"SELECT response_length AS n, entropies AS h FROM rollouts WHERE step IN ({sl})").pl()
        h = np.concatenate([np.asarray(x, dtype=np.float64) for x in frame["h"].to_list()])
        top = np.sort(h)[::-1][: max(1, int(round(0.2 * len(h))))]
        return {"mean_length": float(frame["n"].mean()), "tokens": int(len(h)),
                "top20_entropy_share": float(top.sum() / h.sum()) if h.sum() > 0 else float("nan"),
                "below_0_05": float((h < 0.05).mean()), "below_0_01": float((h < 0.01).mean()),
                "p80_entropy": float(np.quantile(h, 0.8))}

    zero = buf.sql("""SELECT step, avg(CASE WHEN n_correct = 0 OR n_correct = n THEN 1.0 ELSE 0.0 END) AS zv
                      FROM (SELECT step, group_id, count(*) AS n, sum(CAST(correct AS INT)) AS n_correct
                            FROM rollouts GROUP BY step, group_id) GROUP BY step ORDER BY step""").pl()
    # each prompt's visits in order: its group's state at visit k and at visit k + 1
    visits = buf.sql("""
        WITH g AS (SELECT prompt_id, step, count(*) AS n, sum(CAST(correct AS INT)) AS c
                   FROM rollouts GROUP BY prompt_id, step),
             v AS (SELECT prompt_id, step, CASE WHEN c = n THEN 'all_correct' WHEN c = 0 THEN 'all_wrong'
                                                ELSE 'mixed' END AS state,
                          row_number() OVER (PARTITION BY prompt_id ORDER BY step) AS visit FROM g)
        SELECT a.visit, a.state AS before, b.state AS after, count(*) AS k
        FROM v a JOIN v b ON a.prompt_id = b.prompt_id AND b.visit = a.visit + 1
        GROUP BY ALL ORDER BY ALL""").pl()

    def persistence(rows) -> dict:
        out = {}
        for state in ("all_correct", "all_wrong"):
            sub = rows.filter(rows["before"] == state)
            total = int(sub["k"].sum()) if sub.height else 0
            same = int(sub.filter(sub["after"] == state)["k"].sum()) if total else 0
            out[state] = {"groups": total, "again": same, "share": same / total if total else None}
        zero_total = sum(out[s]["groups"] for s in out)
        out["zero_variance"] = {"groups": zero_total, "share": (sum(out[s]["again"] for s in out) / zero_total
                                                                if zero_total else None)}
        return out

    max_visit = int(visits["visit"].max()) if visits.height else 0
    return {
        "steps": int(steps) + 1,
        "warm": tokens([0]),
        "after": tokens(last),
        "zero_variance_per_step": [round(float(x), 3) for x in zero["zv"].to_list()],
        "persistence_first": persistence(visits.filter(visits["visit"] == 1)),
        "persistence_last": persistence(visits.filter(visits["visit"] == max_visit)),
        "persistence_all": persistence(visits),
    }


def _fmt(x, pct=True) -> str:
    if x is None:
        return "–"
    return f"{100 * x:.1f} %" if pct else f"{x:.2f}"


def table(results: dict) -> str:
    rows = []
    for task, r in results.items():
        for when, tok, per in (("warm start", r["warm"], r["persistence_first"]),
                               ("after 24 it.", r["after"], r["persistence_last"])):
            zv = r["zero_variance_per_step"]
            zv_when = zv[0] if when == "warm start" else sum(zv[-4:]) / len(zv[-4:])
            rows.append([task, when, f"{tok['mean_length']:.1f}", _fmt(tok["top20_entropy_share"]),
                         _fmt(tok["below_0_05"]), _fmt(tok["below_0_01"]), f"{tok['p80_entropy']:.3f}", _fmt(zv_when),
                         f"{_fmt(per['all_correct']['share'])} of {per['all_correct']['groups']}",
                         f"{_fmt(per['all_wrong']['share'])} of {per['all_wrong']['groups']}"])
    rows.append(["80/20 paper (Qwen3-8B CoT)", "–", "long", "not stated", "–", "> 50 %", "0.672", "–", "–", "–"])
    return md_table(["task", "when", "mean length", "entropy in top 20 % tokens", "tokens < 0.05 nats",
                     "tokens < 0.01 nats", "80th pct entropy", "zero-variance groups",
                     "all-correct again next visit", "all-wrong again next visit"], rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=["chains", "carries", "arith"], choices=sorted(TASKS))
    p.add_argument("--buffer", action="append", default=[], help="TASK=PATH: measure this loop buffer, run nothing")
    p.add_argument("--root", default="/tmp/rollstore-shape")
    p.add_argument("--iterations", type=int, default=24)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "learning", "shape.json"))
    p.add_argument("--no-record", action="store_true")
    a = p.parse_args(argv)
    given = {}
    for item in a.buffer:
        task, _, path = item.partition("=")
        if task not in TASKS or not os.path.isdir(path):
            p.error(f"--buffer {item}: expected TASK=PATH with TASK one of {sorted(TASKS)} and PATH a buffer folder")
        given[task] = path
    results, seconds = {}, {}
    for task in a.tasks:
        t0 = time.perf_counter()
        root = given.get(task) or run(task, os.path.join(a.root, task), a.seed, a.iterations, a.epochs, a.lr)
        results[task] = measure(root)
        seconds[task] = time.perf_counter() - t0
        print(f"{task}: {json.dumps(results[task])}", flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(results, fh, indent=1)
    text = table(results)
    print(text)
    if not a.no_record:
        append_results(header("Task shape: entropy concentration, zero-variance groups, persistence",
                              extra=("Loop: grpo at μ %d, lr %g, 64 prompts × 8 from a pool of 256, %d iterations, seed %d"
                                     % (a.epochs, a.lr, a.iterations, a.seed),)) + "\n\n" + text
                       + "\n\nPer-step zero-variance shares: "
                       + "; ".join(f"{t}: {r['zero_variance_per_step']}" for t, r in results.items()) + "\n")


if __name__ == "__main__":
    main()
