"""Replay inside TRL (rollstore/trl/plugin.py, docs/trl.md "Replay"): a real `trl.GRPOTrainer` on the
untrained tiny Llama, CPU, one process. A replay recipe puts stored rows of earlier generation
batches into TRL's batch with their tokens, their behaviour log-probs and the decoupled correction."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl", reason="the TRL plug-in needs the optional extra: pip install -e '.[trl]'")

import torch  # noqa: E402
from rollout_helpers import untrained_tiny  # noqa: E402,F401
from test_trl import G, _one_thread, make, parity, rollouts  # noqa: E402,F401  (_one_thread: autouse)
from typer.testing import CliRunner  # noqa: E402

from rollstore.learner.losses import LossConfig, Normalizer, compute_loss  # noqa: E402
from rollstore.cli import app  # noqa: E402
from rollstore.trl import RollstoreGRPOTrainer, TRLPluginError  # noqa: E402
from rollstore.storage.buffer import Buffer  # noqa: E402

CAP = LossConfig().decoupled_cap


def _clone(d: dict) -> dict:
    return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in d.items()}


class Capturing(RollstoreGRPOTrainer):
    """Instrumented, not mocked: keeps each training batch TRL trains on (after the plug-in's rewrite)
    with which rollout each row is, and for every micro-batch holding a replayed row TRL's loss and
    the learner's decoupled loss (learner/losses.py) of the same rows at the same weights."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches: list[dict] = []
        # (TRL, learner decoupled, learner not decoupled, max |log π_θ - log π_prox| on replayed kept tokens)
        self.losses: list[tuple[float, float, float, float]] = []
        self._stored = {}

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.batches.append({"batch": _clone(out), "rows": list(self.rollstore_last_rows),
                                 "replayed": list(self.rollstore_last_replayed),
                                 "advantages": list(self.rollstore_last_advantages) if self.rollstore_last_replayed
                                 else None})
            out["row_index"] = torch.arange(out["completion_ids"].size(0))  # follows TRL's shuffle and split
        return out

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        last = self.batches[-1]
        rows = [last["rows"][int(i)] for i in inputs["row_index"]]
        if last["replayed"] and any(r in last["replayed"] for r in rows) and self.loss_type == "dapo":
            self.losses.append((float(loss.detach()),) + self._learner_losses(inputs, rows, last))
        return loss

    def _learner_losses(self, inputs, rows, last) -> tuple[float, float]:
        if not self._stored:
            self._stored = {r["rollout_id"]: r for r in rollouts(self.rollstore_buffer.root)}
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        C = inputs["completion_ids"].size(1)
        with torch.no_grad():
            logp, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, attn, C)
        prox = inputs["old_per_token_logps"]
        behaviour = prox.clone()  # a fresh row: sampled by these weights
        for j, rid in enumerate(rows):
            if rid in last["replayed"]:
                stored = torch.tensor(self._stored[rid]["old_logprobs"])
                behaviour[j] = 0.0
                behaviour[j, :len(stored)] = stored
        mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
        adv = torch.tensor([last["advantages"][int(i)] for i in inputs["row_index"]])
        norm = Normalizer(int((mask.sum(1) > 0).sum()), int(inputs["num_items_in_batch"]), C)
        cfg = LossConfig(clip_low=self.epsilon_low, clip_high=self.epsilon_high)
        ones = torch.ones(len(rows))
        decoupled = compute_loss("dapo", logp, behaviour, mask, adv, ones, config=cfg, norm=norm, prox_logp=prox).loss
        plain = compute_loss("dapo", logp, behaviour, mask, adv, ones, config=LossConfig(
            clip_low=self.epsilon_low, clip_high=self.epsilon_high, decoupled=False), norm=norm).loss
        replayed = torch.tensor([r in last["replayed"] for r in rows])[:, None] & mask
        drift = float((logp - prox).abs()[replayed].max())  # π_prox: the weights this step trains from
        return float(decoupled), float(plain), drift


def selections(buf_dir):
    with Buffer.open(buf_dir) as buf, buf.snapshot() as snap:
        return snap.arrow("selections").to_table().to_pylist()


def train(model_dir, out, steps=3, lr=0.02, **extra):
    tr = make(Capturing, model_dir, out / "out", [parity], steps=steps, buffer=str(out / "buf"), run_id="run",
              **extra)
    tr.args.learning_rate = lr  # large: one step moves π_prox far enough from π_behav to reach the cap
    tr.train()
    return tr


def check_replayed_rows(tr, buf_dir) -> torch.Tensor:
    """Every row a curation replayed is in that batch's TRL tensors with its stored tokens; its
    ratio base is π_prox and its advantage carries min(π_prox / π_behav, cap). Returns the weights."""
    stored = {r["rollout_id"]: r for r in rollouts(buf_dir)}
    sel = selections(buf_dir)
    curations = [c.curation_id for c in tr.rollstore_curations]
    assert len(curations) == len(tr.batches)
    weights = []
    for step, (cid, b) in enumerate(zip(curations, tr.batches)):
        chosen = {s["rollout_id"]: s for s in sel if s["curation_id"] == cid and s["replayed"] and s["selected"]}
        assert set(b["replayed"]) == set(chosen), step  # the curation's replayed rows, all of them, only them
        batch = b["batch"]
        assert len(b["rows"]) == batch["completion_ids"].size(0)
        assert len(b["rows"]) % tr.args.steps_per_generation == 0
        assert sum(1 for r in b["rows"] if r in chosen) == len(chosen)
        version = next(stored[r]["policy_version"] for r in b["rows"] if r is not None and r not in chosen)
        for j, rid in enumerate(b["rows"]):
            if rid not in chosen:
                continue
            r, s = stored[rid], chosen[rid]
            assert r["step"] < step and s["age"] == version - r["policy_version"] >= 1
            assert batch["prompt_ids"][j][batch["prompt_mask"][j].bool()].tolist() == r["prompt_token_ids"]
            n = len(r["response_token_ids"])
            assert batch["completion_ids"][j, :n].tolist() == r["response_token_ids"]
            keep = batch["tool_mask"][j, :n].bool()
            assert int(keep.sum()) == s["tokens_kept"] > 0
            assert batch["completion_mask"][j].tolist() == [1] * n + [0] * (batch["completion_ids"].size(1) - n)
            prox = batch["old_per_token_logps"][j, :n].float()
            log_w = prox - torch.tensor(r["old_logprobs"])
            if tr.importance_sampling_level == "sequence":  # GSPO: the geometric mean over the kept tokens
                log_w = (log_w[keep].sum() / keep.sum()).expand(n)
            w = torch.clamp(torch.exp(log_w), max=CAP)
            a = b["advantages"][j]
            # the advantage TRL gave the row when it was generated (no amplification in these recipes)
            assert a == pytest.approx(json.loads(r["meta"])["trl_advantage"], rel=1e-5, abs=1e-6)
            torch.testing.assert_close(batch["advantages"][j, :n][keep], (a * w)[keep], rtol=1e-6, atol=0.0)
            weights.append(w[keep])
    return torch.cat(weights)


def test_trl_replay_rollouts_enter_the_batch_with_decoupled_correction(untrained_tiny, tmp_path):  # noqa: F811
    tr = train(untrained_tiny, tmp_path, curate="replay-rollouts",
               curate_sets={"replay_count": 4, "replay_max_uses": 3})
    buf = str(tmp_path / "buf")
    assert len(rollouts(buf)) == 3 * 2 * G
    assert [len(b["replayed"]) for b in tr.batches] == [0, 4, 4]  # steps 1 and 2 replay stored rows
    assert [len(b["rows"]) for b in tr.batches] == [2 * G, 2 * G + 4, 2 * G + 4]  # nothing dropped: it extends
    sel = selections(buf)
    last = tr.rollstore_curations[-1].curation_id
    assert {s["age"] for s in sel if s["curation_id"] == last and s["replayed"] and s["selected"]} <= {1, 2}
    w = check_replayed_rows(tr, buf)
    # the stored behaviour log-probs differ from the current weights: weights != 1, and some are capped
    assert float((w - 1).abs().max()) > 0.1 and bool((w == CAP).any()) and float(w.max()) <= CAP, w
    # TRL's loss on the micro-batches holding replayed rows is the learner's decoupled dapo loss, not the plain one
    assert tr.losses
    for trl_loss, decoupled, plain, drift in tr.losses:
        assert drift < 1e-5  # one micro-step per generation batch: the ratio base is the weights being trained
        assert trl_loss == pytest.approx(decoupled, rel=1e-5, abs=1e-7)
        assert abs(trl_loss - plain) > 1e-3, (trl_loss, plain)
    # `rollstore audit` shows the replayed rows of the last curation
    res = CliRunner().invoke(app, ["audit", buf, last, "--format", "json"])
    assert res.exit_code == 0, res.output
    replay = json.loads(res.output)["replay"]
    assert sum(r["selected"] for r in replay if r["origin"] == "replayed") == 4
    assert {r["age"] for r in replay if r["origin"] == "replayed" and r["selected"]} <= {1, 2}


def test_trl_replay_groups_fill_dropped_slots_with_reference_model(untrained_tiny, tmp_path):  # noqa: F811
    """replay-groups: the zero-variance groups DAPO's filter drops are replaced by stored groups in their
    slots, so TRL's batch keeps its size; with beta != 0 the replayed rows get the reference's log-probs."""
    tr = train(untrained_tiny, tmp_path, curate="replay-groups", cfg={"beta": 0.04})
    buf = str(tmp_path / "buf")
    replays = [len(b["replayed"]) for b in tr.batches]
    assert replays[0] == 0 and sum(replays) > 0, replays
    assert all(len(b["rows"]) == 2 * G for b in tr.batches)
    check_replayed_rows(tr, buf)
    for b in tr.batches:
        for j, rid in enumerate(b["rows"]):
            if rid in b["replayed"]:  # a dropped fresh row's slot: the whole group replaced
                n = int(b["batch"]["completion_mask"][j].sum())
                with torch.no_grad():
                    ids = torch.cat([b["batch"]["prompt_ids"][j:j + 1], b["batch"]["completion_ids"][j:j + 1]], 1)
                    attn = torch.cat([b["batch"]["prompt_mask"][j:j + 1], b["batch"]["completion_mask"][j:j + 1]], 1)
                    ref, _, _ = tr._get_per_token_logps_and_entropies(tr.ref_model, ids, attn, ids.size(1) -
                                                                     b["batch"]["prompt_ids"].size(1))
                torch.testing.assert_close(b["batch"]["ref_per_token_logps"][j, :n], ref[0, :n], rtol=1e-5,
                                           atol=1e-5)


def test_trl_replay_with_steps_per_generation_pads_whole_micro_batches(untrained_tiny, tmp_path):  # noqa: F811
    """steps_per_generation=2 (TRL computes old_per_token_logps itself; a generation batch spans two
    optimizer steps, so the previous batch is 2 versions old): 3 replayed rows make 16 + 3, and one
    filler row (masked out) makes the batch split evenly into TRL's two micro-batches."""
    tr = train(untrained_tiny, tmp_path, steps=6, curate="replay-rollouts",
               curate_sets={"replay_count": 3, "replay_max_uses": 3}, cfg={"steps_per_generation": 2})
    buf = str(tmp_path / "buf")
    replays = [len(b["replayed"]) for b in tr.batches]
    assert len(tr.batches) == 3 and 3 in replays, replays  # (batch 0 here is all one reward: nothing to replay)
    for b, n in zip(tr.batches, replays):
        fillers = n % 2
        assert len(b["rows"]) == 4 * G + n + fillers and b["rows"].count(None) == fillers
        if fillers:
            assert b["rows"][-1] is None  # the filler: nothing in the loss
            assert int(b["batch"]["tool_mask"][-1].sum()) == 0 and b["batch"]["advantages"][-1].abs().sum() == 0
    check_replayed_rows(tr, buf)


@pytest.mark.parametrize("recipe", ["replay-groups", "replay-rollouts", "replay-d3s", "replay-window",
                                    "replay-rollouts-x3"])
def test_trl_replay_builtin_recipes(untrained_tiny, tmp_path, recipe):  # noqa: F811
    """Every built-in replay recipe runs inside TRL and its replayed rows enter the batch as stored."""
    tr = train(untrained_tiny, tmp_path, curate=recipe)
    assert sum(len(b["replayed"]) for b in tr.batches) > 0
    check_replayed_rows(tr, str(tmp_path / "buf"))


def test_trl_replay_sequence_level_weight_is_capped_geometric_mean(untrained_tiny, tmp_path):  # noqa: F811
    """importance_sampling_level="sequence" (GSPO, loss_type grpo): one weight per replayed row, the
    geometric mean of π_prox / π_behav over its kept tokens, capped (learner/losses.py's gspo)."""
    tr = train(untrained_tiny, tmp_path, curate="replay-rollouts", curate_sets={"replay_count": 4, "replay_max_uses": 3},
               cfg={"importance_sampling_level": "sequence", "loss_type": "grpo"})
    assert sum(len(b["replayed"]) for b in tr.batches) > 0
    w = check_replayed_rows(tr, str(tmp_path / "buf"))
    assert float((w - 1).abs().max()) > 0.1


def test_trl_replay_refusals(untrained_tiny, tmp_path):  # noqa: F811
    with pytest.raises(TRLPluginError, match="current_version is set by the TRL plug-in"):
        make(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "o", [parity], buffer=str(tmp_path / "b"),
             curate="replay-groups", curate_sets={"current_version": 3})
    # a recipe made to replay by curate_sets is a replay recipe too
    tr = make(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "o2", [parity], buffer=str(tmp_path / "b2"),
              curate="dapo", curate_sets={"replay": "groups"})
    assert tr.rollstore_replay


def test_trl_replay_refused_under_accelerate_two_processes(untrained_tiny, tmp_path):  # noqa: F811
    """Replay inside TRL is one-process: under `accelerate launch --num_processes 2` (CPU, gloo) every
    process refuses a replay recipe at construction with the same one line, before training."""
    import os
    import subprocess
    import sys

    from test_trl import _free_port

    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_ranks_script.py")
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                          "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
                          script, untrained_tiny, str(tmp_path / "buf"), str(out), "replay-groups"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    msgs = [json.loads((out / f"rank{r}.json").read_text())["refused"] for r in (0, 1)]
    assert msgs[0] == msgs[1] and "replay recipes run in one process inside TRL (this run has 2)" in msgs[0]
    assert "\n" not in msgs[0]


@pytest.mark.parametrize("recipe", ["d3s", "replay-rollouts"])
def test_trl_num_iterations_with_curation_and_replay(untrained_tiny, tmp_path, recipe):  # noqa: F811
    """μ = 2 (TRL's `num_iterations`): each generation batch is recorded and curated once, then trained
    twice by TRL with the clip against the log-probs it was sampled with; a replay recipe's stored rows
    enter the batch as stored (their policy version is 2 optimiser steps per batch behind)."""
    tr = train(untrained_tiny, tmp_path, steps=6, curate=recipe,
               curate_sets={"replay_window": 4, "replay_max_uses": 3} if recipe.startswith("replay") else {},
               cfg={"num_iterations": 2})
    buf = str(tmp_path / "buf")
    assert len(tr.batches) == 3  # 6 optimiser steps, two per generation batch
    assert sorted({r["step"] for r in rollouts(buf)}) == [0, 1, 2]
    assert sorted({r["policy_version"] for r in rollouts(buf)}) == [0, 2, 4]
    curations = {s["curation_id"] for s in selections(buf)}
    assert len(curations) == 3  # one per generation batch, not per pass
    if recipe.startswith("replay"):
        assert sum(len(b["replayed"]) for b in tr.batches) > 0
        check_replayed_rows(tr, buf)
