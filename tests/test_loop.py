"""The near-on-policy loop, its resume, the two-process mode, `rollstore eval` and the demo, on
the built-in tiny policy (built once per session into a temporary cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from rollstore.learner.checkpoint import consumed_ledger, latest_checkpoint, list_checkpoints
from rollstore.queries.session import Session
from rollout_helpers import default_tiny, tiny_cache  # noqa: F401  (fixtures)
from rollstore.loop import LoopConfig, run_loop
from rollstore.storage.buffer import Buffer

BIN = os.path.join(os.path.dirname(sys.executable), "rollstore")


def sql(root: str, query: str):
    with Buffer.open(root) as buf, buf.snapshot() as snap, Session(snap) as s:
        return s.execute(query).fetchall()


def curated_shards(root: str) -> int:
    with Buffer.open(root) as buf:
        return len(buf.manifest.shards("curated"))


def small(root: str, model: str, **kw) -> LoopConfig:
    d = LoopConfig(buffer=root)
    base = dict(buffer=root, model=model, iterations=3, recipe="d3s", prompts_per_iter=16,
                generation=replace(d.generation, group_size=4), eval_every=0, run_id="t", train=replace(d.train, lr=2e-5))
    base.update(kw)
    return LoopConfig(**base)


def test_loop_publishes_one_version_per_iteration_and_resumes(tmp_path, default_tiny):
    root = str(tmp_path / "buf")
    Buffer.init(root).close()
    summary = run_loop(small(root, default_tiny))
    assert [r["version"] for r in summary["iterations"]] == [1, 2, 3]
    progress = [r[0] for r in sql(root, "SELECT progress FROM curations ORDER BY progress")]
    assert progress == pytest.approx([0, 1 / 3, 2 / 3])
    # every curation's shards are trained exactly once, each into the version after its rollouts
    with Buffer.open(root) as buf:
        ledger = consumed_ledger(buf, 3)
        curated = {s.path for s in buf.snapshot().shards("curated")}
    assert sorted(e["shard"] for e in ledger) == sorted(curated)
    assert len({e["shard"] for e in ledger}) == len(ledger)
    versions = sql(root, "SELECT step, min(policy_version), max(policy_version) FROM rollouts GROUP BY step ORDER BY step")
    assert versions == [(0, 0, 0), (1, 1, 1), (2, 2, 2)]  # generation always uses the newest version
    steps = sql(root, "SELECT count(*), count(DISTINCT step) FROM training")
    assert steps[0][0] == steps[0][1] > 0
    # a second call resumes: one more iteration, nothing retrained
    summary = run_loop(small(root, default_tiny, iterations=4))
    assert [r["iteration"] for r in summary["iterations"]] == [3]
    with Buffer.open(root) as buf:
        assert latest_checkpoint(buf).version == 4
        ledger = consumed_ledger(buf, 4)
    assert len(ledger) == len({e["shard"] for e in ledger})


def test_the_loop_compacts_every_n_iterations_and_trains_each_row_once(tmp_path, default_tiny, cli):
    """`compact_every`: every N iterations the loop merges the small shards it left (rollouts, audits,
    prompt selections); every curated row still resolves and is trained exactly once."""
    from rollstore.rules import OptionError

    root = str(tmp_path / "buf")
    Buffer.init(root).close()
    summary = run_loop(small(root, default_tiny, iterations=4, compact_every=2))
    assert [r["version"] for r in summary["iterations"]] == [1, 2, 3, 4]
    assert ["compaction" in r["phases"] for r in summary["iterations"]] == [False, True, False, True]
    with Buffer.open(root) as buf:
        live = buf.manifest.shards("rollouts")
        # one merged shard per 2 iterations: each compaction merges the steps since the last, never its merged shards
        assert len(live) == 2 and sum(s.rows for s in live) == sum(r["rollouts"] for r in summary["iterations"])
        assert len(buf.manifest.shards("selections")) < 4  # the audits merged too
        ledger = consumed_ledger(buf, 4)
        curated = {s.path for s in buf.snapshot().shards("curated")}
    assert sorted(e["shard"] for e in ledger) == sorted(curated) and len({e["shard"] for e in ledger}) == len(ledger)
    kept = sql(root, "SELECT count(*) FROM curated")[0][0]
    assert kept == sum(r["samples_kept"] for r in summary["iterations"]) > 0  # every reference followed its move
    with pytest.raises(OptionError, match="compact_every"):
        small(root, default_tiny, compact_every=-1).check()
    res = cli("loop", str(tmp_path / "other"), "--compact-every", "-1")
    assert res.code != 0 and "compact-every" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_filtering_recipe_over_generates(tmp_path, default_tiny):
    root = str(tmp_path / "buf")
    Buffer.init(root).close()
    summary = run_loop(small(root, default_tiny, recipe="dapo", iterations=1, max_gen_batches=2))
    it = summary["iterations"][0]
    survived = sql(root, "SELECT count(*) FROM groups WHERE accuracy > 0 AND accuracy < 1")[0][0]
    assert it["gen_batches"] >= 1
    assert it["gen_batches"] == 2 or survived >= 16
    assert sql(root, "SELECT count(DISTINCT group_id) FROM rollouts")[0][0] == 32 * it["gen_batches"]


def test_replay_recipe_in_the_loop_reuses_stored_groups_without_generating_more(tmp_path, default_tiny):
    """`replay-groups` in the one-process loop: one generation batch per step (no over-generation),
    rows of earlier steps trained again within the window and the use cap, every curated shard
    trained exactly once, and the audit says which rows were replayed and how old they were."""
    root = str(tmp_path / "buf")
    Buffer.init(root).close()
    summary = run_loop(small(root, default_tiny, recipe="replay-groups", iterations=4))
    assert [r["gen_batches"] for r in summary["iterations"]] == [1, 1, 1, 1]
    assert sql(root, "SELECT count(DISTINCT group_id) FROM rollouts")[0][0] == 4 * 16
    replayed = sql(root, "SELECT count(*), min(age), max(age) FROM selections WHERE selected AND replayed")[0]
    fresh = sql(root, "SELECT count(*), max(age) FROM selections WHERE selected AND NOT replayed")[0]
    assert fresh[0] > 0 and fresh[1] == 0
    zero = sql(root, "SELECT count(*) FROM selections s JOIN curations c USING (curation_id) "
                     "WHERE s.reason = 'zero_variance' AND NOT s.replayed AND c.progress > 0")[0][0]
    if zero:  # the fresh batches after the first had zero-variance groups to replace
        assert replayed[0] > 0 and 1 <= replayed[1] <= replayed[2] <= 2
    uses = sql(root, "SELECT max(n) FROM (SELECT rollout_id, count(DISTINCT curation_id) AS n FROM selections "
                     "WHERE selected GROUP BY rollout_id)")[0][0]
    assert uses <= 2  # replay_max_uses, the first use included
    with Buffer.open(root) as buf:
        ledger = consumed_ledger(buf, 4)
        curated = {s.path for s in buf.snapshot().shards("curated")}
    assert sorted(e["shard"] for e in ledger) == sorted(curated) and len(ledger) == len(curated)


def test_two_process_mode_respects_the_staleness_bound(tmp_path, default_tiny):
    """The learner starts once the generator's first curation is committed (so the generator is made
    to wait for v1 before step 2), and its --max-idle only has to outlast the gaps between steps, not
    both processes' start-up: it ends on its own after the last one."""
    root = str(tmp_path / "buf")
    Buffer.init(root).close()
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
    gen = subprocess.Popen(
        [BIN, "generate", root, "--model", default_tiny, "--follow", "--steps", "3", "--num-prompts", "16",
         "-G", "4", "--max-policy-lag", "1", "--run-id", "gen", "--recipe", "replay-groups"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    learner = None
    try:
        deadline = time.monotonic() + 300
        while gen.poll() is None and time.monotonic() < deadline and not curated_shards(root):
            time.sleep(0.2)
        learner = subprocess.Popen(
            [BIN, "train", root, "--model", default_tiny, "--follow", "--max-idle", "10", "--run-id", "learner",
             "--lr", "2e-5", "--poll", "0.2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        _, gen_err = gen.communicate(timeout=600)
        assert gen.returncode == 0, gen_err
    finally:
        gen.kill()
        if learner is not None:
            out, err = learner.communicate(timeout=600)
    assert learner.returncode == 0, err
    with Buffer.open(root) as buf:
        cks = list_checkpoints(buf)
        assert [c.version for c in cks] == [1, 2, 3]
        ledger = consumed_ledger(buf, 3)
        curated = {s.path for s in buf.snapshot().shards("curated")}
    assert sorted(e["shard"] for e in ledger) == sorted(curated)
    # step i was generated by version ≥ i − lag, and each curation trained exactly once
    for step, version in sql(root, "SELECT step, max(policy_version) FROM rollouts GROUP BY step"):
        assert version >= step - 1
    assert sql(root, "SELECT count(*) FROM curations")[0][0] == 3


def test_eval_command(default_tiny):
    res = subprocess.run([BIN, "eval", "--model", default_tiny, "--samples", "4", "--k", "1,4", "--num-prompts",
                          "24", "--format", "json"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    metrics = json.loads(res.stdout.strip().splitlines()[-1])
    assert 0 <= metrics["pass@1"] <= metrics["pass@4"] <= 1
    assert metrics["avg@4"] == pytest.approx(metrics["pass@1"])
    bad = subprocess.run([BIN, "eval", "--model", default_tiny, "--samples", "2", "--k", "1,8"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--samples" in bad.stderr


def test_demo_command(tmp_path, default_tiny, monkeypatch):
    root = str(tmp_path / "demo")
    res = subprocess.run([BIN, "demo", root, "--iterations", "2", "--model", default_tiny],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "held-out greedy accuracy" in res.stdout and "before" in res.stdout
    assert res.stdout.count("rollstore sql") == 3 and "rollstore audit" in res.stdout
    assert sql(root, "SELECT count(*) FROM evaluations")[0][0] == 2
    # a second demo replaces its own buffer; a foreign directory is refused
    assert subprocess.run([BIN, "demo", root, "--iterations", "1", "--model", default_tiny],
                          capture_output=True, text=True).returncode == 0
    other = tmp_path / "mine"
    other.mkdir()
    res = subprocess.run([BIN, "demo", str(other)], capture_output=True, text=True)
    assert res.returncode != 0 and "not a demo buffer" in res.stderr


@pytest.mark.slow
def test_the_demo_settings_learn_by_a_wide_margin(tmp_path, default_tiny):
    """The demo's settings (d3s, LoopConfig defaults, one torch thread) for 12 iterations: the start
    has mixed groups on every level, and greedy accuracy on the distinct held-out prompts gains at
    least 15 points (this machine: about +60), so other CPUs' float kernels cannot flip it."""
    from rollstore.rollout import arith

    root = str(tmp_path / "learn")
    Buffer.init(root).close()
    summary = run_loop(LoopConfig(buffer=root, model=default_tiny, iterations=12, eval_every=6, run_id="learn"))
    accs = [acc for _, _, acc in summary["evals"]]
    assert len(accs) == 3 and accs[-1] - accs[0] >= 0.15, accs
    stored = sql(root, "SELECT iteration, value FROM evaluations WHERE metric = 'greedy_accuracy' ORDER BY iteration")
    assert [round(v, 6) for _, v in stored] == [round(a, 6) for a in accs]
    mixed = sql(root, "SELECT avg((accuracy > 0 AND accuracy < 1)::INT) FROM groups g JOIN "
                      "(SELECT DISTINCT group_id FROM rollouts WHERE step = 0) USING (group_id)")[0][0]
    assert mixed >= 0.4, mixed
    per_level = sql(root, "SELECT prompt, avg(correct::INT) FROM rollouts WHERE step = 0 GROUP BY prompt")
    by_level: dict[int, list[float]] = {}
    for prompt, acc in per_level:
        a, b = (int(x) for x in prompt[:-1].split("+"))
        by_level.setdefault(arith.level_of(a, b), []).append(acc)
    assert sorted(by_level) == [1, 2, 3]
    for level, accs_ in by_level.items():
        assert 0.10 <= sum(accs_) / len(accs_) <= 0.70, (level, sum(accs_) / len(accs_))
    sampled = sql(root, "SELECT step // 6 AS q, avg(coalesce(correct, false)::INT) FROM rollouts GROUP BY q ORDER BY q")
    assert sampled[-1][1] > sampled[0][1] + 0.1, sampled


def test_loop_with_a_two_rank_learner(tmp_path, default_tiny):
    """`rollstore loop --learner-ranks 2`: the generator alternates with a 2-rank DDP learner under
    torchrun; every curation is trained exactly once, each into the version after its rollouts."""
    root = str(tmp_path / "ranks")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([BIN, "loop", root, "--model", default_tiny, "--learner-ranks", "2", "--iterations", "3",
                          "--prompts-per-iter", "16", "-G", "4", "--run-id", "r", "--recipe", "replay-d3s"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "the 2-rank learner published v3" in res.stdout
    with Buffer.open(root) as buf:
        assert [c.version for c in list_checkpoints(buf)] == [1, 2, 3]
        ledger = consumed_ledger(buf, 3)
        curated = {s.path for s in buf.snapshot().shards("curated")}
    assert sorted(e["shard"] for e in ledger) == sorted(curated) and len(ledger) == len(curated) == 3
    assert sql(root, "SELECT step, max(policy_version) FROM rollouts GROUP BY step ORDER BY step") == [(0, 0), (1, 1), (2, 2)]
