"""The TRL plug-in (rollstore/trl/plugin.py) with a real `trl.GRPOTrainer` on the untrained tiny Llama, CPU.

Rewards are test-controlled functions of the completion, so group variance is known: the prompt
"1+1=" gets a constant reward (a zero-variance group), the others a reward that depends on the
completion's length parity (groups with variance, almost surely).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("trl", reason="the TRL plug-in needs the optional extra: pip install -e '.[trl]'")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from rollout_helpers import untrained_tiny  # noqa: E402,F401
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from rollstore.rollout.arith import train_prompts  # noqa: E402
from rollstore.cli import app  # noqa: E402
from rollstore.trl import CorrectRule, RollstoreGRPOTrainer  # noqa: E402
from rollstore.storage.buffer import Buffer  # noqa: E402

G = 4
CONSTANT = "1+1="


def parity(completions, completion_ids, prompts, **kw):
    """1 for an even-length completion; 1 for every completion of the constant prompt."""
    return [1.0 if p == CONSTANT else float(len(c) % 2 == 0) for p, c in zip(prompts, completion_ids)]


parity.rollstore_correct = True


def scaled(completions, completion_ids, prompts, **kw):
    """A second reward function: a length-dependent reward scaled large, 0 on the constant prompt."""
    return [0.0 if p == CONSTANT else 1000.0 * len(c) for p, c in zip(prompts, completion_ids)]


def dataset():
    texts = [CONSTANT] + [p.prompt for p in train_prompts(3, seed=1)]
    return Dataset.from_list([{"prompt": t, "answer": str(i)} for i, t in enumerate(texts)])


def config(out, steps=2, **kw):
    kw.setdefault("save_strategy", "no")
    return GRPOConfig(
        output_dir=str(out), num_generations=G, per_device_train_batch_size=2 * G, max_completion_length=6,
        max_steps=steps, learning_rate=1e-3, logging_steps=1, report_to=[],
        use_cpu=True, seed=0, temperature=1.0, dataloader_num_workers=0, disable_tqdm=True, **kw)


def make(cls, model_dir, out, funcs, steps=2, **extra):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    cfg_kw = extra.pop("cfg", {})
    return cls(model=model, reward_funcs=funcs, args=config(out, steps, **cfg_kw), train_dataset=dataset(),
               processing_class=tok, **extra)


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def rollouts(buf_dir):
    with Buffer.open(buf_dir) as buf, buf.snapshot() as snap:
        return snap.arrow("rollouts").to_table().to_pylist()


def test_recorder_rows_groups_versions(untrained_tiny, tmp_path):  # noqa: F811
    buf = str(tmp_path / "buf")
    tr = make(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "out", [parity, scaled], steps=2,
              buffer=buf, run_id="run", record_entropies=True)
    tr.train()
    rows = rollouts(buf)
    assert len(rows) == 2 * 2 * G  # two generation batches of 2 prompts x G completions
    for r in rows:
        assert len(r["gen_logprobs"]) == len(r["old_logprobs"]) == len(r["entropies"]) == len(r["response_token_ids"])
        meta = json.loads(r["meta"])
        assert set(meta["rewards"]) == {"parity", "scaled"}
        assert r["reward"] == pytest.approx(meta["rewards"]["parity"] + meta["rewards"]["scaled"])
        assert r["correct"] == (meta["rewards"]["parity"] >= 1.0)
        assert r["policy_version"] == r["step"]  # one generation batch per optimizer step here
        assert isinstance(meta["trl_advantage"], float)
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    assert len(groups) == 4 and all(len(g) == G for g in groups.values())
    for g in groups.values():
        assert len({r["prompt"] for r in g}) == 1 and sorted(r["sample_idx"] for r in g) == list(range(G))
        assert len({r["step"] for r in g}) == 1
    assert {r["policy_version"] for r in rows} == {0, 1}



def shaping(completions, completion_ids, prompts, **kw):
    """A small shaping reward (0.01 per token): on the constant prompt the group's std is ~0.01."""
    return [0.01 * len(c) for c in completion_ids]


def trained_params(cls, model_dir, out, funcs, steps=2, **extra):
    tr = make(cls, model_dir, out, funcs, steps=steps, **extra)
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    return tr, before, [p.detach().clone() for p in tr.model.parameters()]


def param_gap(a: list, b: list, before: list) -> tuple[float, float]:
    """(max |a - b|, that / max |a - before|): the difference relative to the largest update."""
    diff = max(float((x - y).abs().max()) for x, y in zip(a, b))
    step = max(float((x - y).abs().max()) for x, y in zip(a, before))
    return diff, diff / step


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_trl_grpo_recipe_reproduces_vanilla_parameters(untrained_tiny, tmp_path, scale_rewards):  # noqa: F811
    """curate="grpo" inside TRL trains exactly as plain GRPOTrainer: TRL's std + 1e-4 and its
    scale_rewards mode, not rollstore's std + 1e-6; a small-std shaping reward makes the constant matter."""
    cfg = {"scale_rewards": scale_rewards}
    _, before, vanilla = trained_params(GRPOTrainer, untrained_tiny, tmp_path / "v", [parity, shaping], cfg=cfg)
    tr, _, curated = trained_params(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "c", [parity, shaping],
                                    buffer=str(tmp_path / "buf"), curate="grpo", cfg=cfg)
    stds = [json.loads(r["meta"])["rewards"]["shaping"] for r in rollouts(str(tmp_path / "buf"))]
    assert len(stds) == 4 * G and len(tr.rollstore_curations) == 2
    diff, rel = param_gap(vanilla, curated, before)
    print(f"scale_rewards={scale_rewards}: max |dparam| {diff:.3e}, relative to the largest update {rel:.3e}")
    assert rel <= 1e-4, (diff, rel)
    if scale_rewards == "group":  # the test can tell: rollstore's own constant (std + 1e-6) does not match
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(RollstoreGRPOTrainer, "_trl_scale", lambda self, n: [1.0] * n)
            _, _, own = trained_params(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "o", [parity, shaping],
                                       buffer=str(tmp_path / "buf-own"), curate="grpo", cfg=cfg)
        diff, rel = param_gap(vanilla, own, before)
        print(f"with std + 1e-6: max |dparam| {diff:.3e}, relative to the largest update {rel:.3e}")
        assert rel > 0.1


def first_loss(cls, model_dir, out, funcs, **extra):
    tr = make(cls, model_dir, out, funcs, steps=1, **extra)
    tr.train()
    return tr, tr.state.log_history[0]["loss"]


def test_grpo_recipe_matches_vanilla_loss(untrained_tiny, tmp_path):  # noqa: F811
    _, vanilla = first_loss(GRPOTrainer, untrained_tiny, tmp_path / "v", [parity, scaled])
    tr, curated = first_loss(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "c", [parity, scaled],
                             buffer=str(tmp_path / "buf"), curate="grpo")
    print(f"vanilla {vanilla!r} curated {curated!r} diff {abs(vanilla - curated):.3e}")
    assert abs(vanilla - curated) <= 1e-6


def test_dapo_drops_zero_variance_groups(untrained_tiny, tmp_path):  # noqa: F811
    buf = str(tmp_path / "buf")
    tr = make(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "out", [parity], steps=1,
              buffer=buf, run_id="dapo", curate="dapo")
    seen = {}
    original = tr._compute_loss

    def spy(model, inputs):
        seen["inputs"] = inputs
        return original(model, inputs)

    tr._compute_loss = spy
    tr.train()
    rows = rollouts(buf)
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault(r["group_id"], []).append(r)
    with Buffer.open(buf) as b, b.snapshot() as snap:
        sel = snap.arrow("selections").to_table().to_pylist()
    reasons = {s["rollout_id"]: (s["selected"], s["reason"]) for s in sel}
    assert set(reasons) == {r["rollout_id"] for r in rows}
    for gid, g in by_prompt.items():
        zero_var = len({r["correct"] for r in g}) == 1
        for r in g:
            selected, reason = reasons[r["rollout_id"]]
            assert selected == (not zero_var), (gid, reason)
            if zero_var:
                assert reason == "zero_variance", (gid, reason)
    assert any(len({r["correct"] for r in g}) == 1 for g in by_prompt.values())  # the constant prompt
    inputs = seen["inputs"]
    mask = inputs["completion_mask"] * inputs["tool_mask"]
    # the rows whose whole loss mask is zero are exactly the dropped ones, and have zero advantage
    dropped = (mask.sum(-1) == 0)
    assert dropped.any()
    assert torch.all(inputs["advantages"][dropped] == 0)

    # `rollstore audit` and `rollstore report` on the buffer TRL filled
    runner = CliRunner()
    res = runner.invoke(app, ["audit", buf])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["report", buf, "--out", str(tmp_path / "report.html")])
    assert res.exit_code == 0, res.output
    assert os.path.getsize(tmp_path / "report.html") > 0


def _grads(tr, inputs):
    tr.model.zero_grad()
    tr._compute_loss(tr.model, inputs).backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in tr.model.parameters()]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_dapo_dropped_rows_contribute_zero_gradient(untrained_tiny, tmp_path, loss_type):  # noqa: F811
    """Dropped rows add nothing to the gradient. Under loss_type dapo (token sum / kept tokens) the
    curated batch's gradient equals its kept rows' alone; under loss_type grpo (mean over rows) a
    dropped row still counts in the mean, so it is the kept rows' gradient x kept / batch rows."""
    tr = make(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "out", [parity], steps=1,
              buffer=str(tmp_path / "buf"), curate="dapo", cfg={"loss_type": loss_type})
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # set by Trainer.train(); this test calls the loss directly
    rows = dataset().to_list()[:2]  # the constant prompt (zero variance) and one with variance
    batch = tr._generate_and_score_completions([r for r in rows for _ in range(G)])
    kept = (batch["completion_mask"] * batch["tool_mask"]).sum(-1) > 0
    assert 0 < int(kept.sum()) < kept.numel()
    sliced = {k: (v[kept] if torch.is_tensor(v) and v.dim() > 0 and v.size(0) == kept.numel() else v)
              for k, v in batch.items()}
    full, only_kept = _grads(tr, batch), _grads(tr, sliced)
    scale = 1.0 if loss_type == "dapo" else int(kept.sum()) / kept.numel()
    # Equal up to rounding. TRL's GRPOConfig trains under bf16 autocast on the CPU, and the two
    # batches reduce in different shapes, so entries may differ by a bf16 ulp or two (2^-8
    # relative); a dropped row that counted, or a wrong scale, moves them by far more than that.
    top = max(float(a.abs().max()) for a in full)
    assert top > 0
    for a, b in zip(full, only_kept):
        assert torch.allclose(a, scale * b, rtol=2**-6, atol=1e-3 * top), float((a - scale * b).abs().max())


def test_d3s_curation_records_entropies_and_masks_tokens(untrained_tiny, tmp_path):  # noqa: F811
    buf = str(tmp_path / "buf")
    tr = make(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "out", [parity], steps=2,
              buffer=buf, run_id="d3s", curate="d3s")
    tr.train()
    rows = rollouts(buf)
    assert len(rows) == 2 * 2 * G and all(r["entropies"] is not None for r in rows)
    assert len(tr.rollstore_curations) == 2
    with Buffer.open(buf) as b, b.snapshot() as snap:
        sel = snap.arrow("selections").to_table().to_pylist()
        curated = snap.arrow("curated").to_table().to_pylist()
    assert len(sel) == len(rows) and all(s["reason"] for s in sel)
    assert curated and any(any(m) and not all(m) for m in (c["loss_mask"] for c in curated))  # top-|A|*H tokens


def test_correct_rule_names_the_function_and_its_threshold(untrained_tiny, tmp_path):  # noqa: F811
    """correct_reward=CorrectRule(name, threshold): correct = that function's reward >= threshold."""
    buf = str(tmp_path / "buf")
    tr = make(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "out", [parity, scaled], steps=1, buffer=buf,
              correct_reward=CorrectRule("scaled", threshold=3000.0))
    tr.train()
    rows = rollouts(buf)
    scores = [json.loads(r["meta"])["rewards"]["scaled"] for r in rows]
    assert [r["correct"] for r in rows] == [v >= 3000.0 for v in scores]
    assert len(set(r["correct"] for r in rows)) == 2  # the threshold splits this batch


def test_curate_without_a_correct_function_is_refused(untrained_tiny, tmp_path):  # noqa: F811
    from rollstore.trl import TRLPluginError

    with pytest.raises(TRLPluginError, match="curation needs `correct`"):
        make(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "out", [scaled], buffer=str(tmp_path / "b"), curate="dapo")


def test_prompt_selection_is_refused_in_one_line(untrained_tiny, tmp_path):  # noqa: F811
    """The plug-in generates what TRL hands it: pre-rollout prompt selection would do nothing there."""
    from rollstore.curate.params import ParamError

    with pytest.raises(ParamError, match="prompt_skip=greso: .*the TRL plug-in would ignore it") as info:
        make(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "out", [scaled], buffer=str(tmp_path / "b"),
             curate="grpo", curate_sets={"prompt_skip": "greso"})
    assert "\n" not in str(info.value)


README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def readme_snippet() -> str:
    """The python block of README.md's "Using rollstore from TRL" section, verbatim."""
    with open(README) as fh:
        section = fh.read().split("## Using rollstore from TRL\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_snippet_runs(untrained_tiny, tmp_path, monkeypatch):  # noqa: F811
    """README's TRL snippet, exactly as printed, on a script's `model` (a local path, as TRL
    accepts), `config` and `dataset`: it records every completion and curates with d3s."""
    code = readme_snippet()
    assert len([line for line in code.splitlines() if line.strip()]) < 10
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    scope = {"model": untrained_tiny, "config": config(tmp_path / "out", steps=1), "dataset": dataset()}
    exec(compile(code, README, "exec"), scope)
    assert isinstance(scope["trainer"], RollstoreGRPOTrainer) and scope["trainer"].state.global_step == 1
    rows = rollouts(str(tmp_path / "rollstore-buf"))
    assert len(rows) == 2 * G and all(r["entropies"] is not None for r in rows)
    with Buffer.open(str(tmp_path / "rollstore-buf")) as b, b.snapshot() as snap:
        sel = snap.arrow("selections").to_table().to_pylist()
        recipes = snap.arrow("curations").to_table(columns=["recipe"]).column("recipe").to_pylist()
    assert {s["rollout_id"] for s in sel} == {r["rollout_id"] for r in rows} and recipes == ["d3s"]


def test_trl_resume_from_checkpoint_continues_the_run(untrained_tiny, tmp_path):  # noqa: F811
    """resume_from_checkpoint with the same run_id: the steps continue from TRL's global_step (no
    "rollout_id already in the buffer"), policy_version = step; resuming from an EARLIER checkpoint,
    the batches the stopped run generated after it keep their steps, and the resumed ones follow."""
    buf, out = str(tmp_path / "buf"), tmp_path / "out"
    save = {"save_strategy": "steps", "save_steps": 1}
    make(RollstoreGRPOTrainer, untrained_tiny, out, [parity], steps=2, buffer=buf, run_id="r",
         curate="dapo", cfg=save).train()
    tr = make(RollstoreGRPOTrainer, untrained_tiny, out, [parity], steps=3, buffer=buf, run_id="r",
              curate="dapo", cfg=save)
    tr.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    rows = rollouts(buf)
    assert sorted({(r["step"], r["policy_version"]) for r in rows}) == [(0, 0), (1, 1), (2, 2)]
    assert len(rows) == 3 * 2 * G and tr.state.global_step == 3
    # the run stopped after step 2 but a new process resumes from checkpoint-1: step 1's batch exists
    tr = make(RollstoreGRPOTrainer, untrained_tiny, out, [parity], steps=2, buffer=buf, run_id="r",
              curate="dapo", cfg=save)
    tr.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    rows = rollouts(buf)
    assert sorted({(r["step"], r["policy_version"]) for r in rows}) == [(0, 0), (1, 1), (2, 2), (3, 1)]
    with Buffer.open(buf) as b, b.snapshot() as snap:
        audits = snap.arrow("curations").to_table(columns=["curation_id"]).num_rows
    assert audits == 4  # one curation per recorded batch


def sometimes(completions, completion_ids, prompts, **kw):
    """A correctness reward that does not apply to the constant prompt (None there, as TRL allows)."""
    return [None if p == CONSTANT else float(len(c) % 2 == 0) for p, c in zip(prompts, completion_ids)]


sometimes.rollstore_correct = True


def test_trl_none_correct_reward_is_dropped_and_warned(untrained_tiny, tmp_path, caplog):  # noqa: F811
    """Documented difference from TRL (docs/trl.md): a row whose correct function returned None has no
    verdict; curation drops it as `invalid` even under grpo (TRL would train on it with the other
    rewards), and the plug-in says so once."""
    buf = str(tmp_path / "buf")
    tr = make(RollstoreGRPOTrainer, untrained_tiny, tmp_path / "out", [sometimes, shaping], steps=1,
              buffer=buf, run_id="n", curate="grpo")
    seen = {}
    original = tr._compute_loss

    def spy(model, inputs):
        seen["inputs"] = inputs
        return original(model, inputs)

    tr._compute_loss = spy
    with caplog.at_level("WARNING", logger="rollstore.trl"):
        tr.train()
    rows = {r["rollout_id"]: r for r in rollouts(buf)}
    with Buffer.open(buf) as b, b.snapshot() as snap:
        sel = snap.arrow("selections").to_table().to_pylist()
    none_rows = [r for r in rows.values() if r["prompt"] == CONSTANT]
    assert len(none_rows) == G and all(r["correct"] is None and r["reward"] > 0 for r in none_rows)
    reasons = {s["rollout_id"]: s["reason"] for s in sel}
    assert {reasons[r["rollout_id"]] for r in none_rows} == {"invalid"}
    assert {reasons[rid] for rid, r in rows.items() if r["prompt"] != CONSTANT} == {"selected"}
    mask = seen["inputs"]["completion_mask"] * seen["inputs"]["tool_mask"]
    assert int((mask.sum(-1) == 0).sum()) == G
    assert sum("have no verdict" in rec.getMessage() for rec in caplog.records) == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trl_accelerate_two_processes_record_and_curate_once(untrained_tiny, tmp_path):  # noqa: F811
    """`accelerate launch --num_processes 2` on CPU (gloo; tests/trl_ranks_script.py): every completion of
    every process recorded exactly once, one shard and one curation (one audit) per generation batch
    over both processes' rows (groups straddle the processes), the same decisions on both processes,
    and the advantages TRL trains with are the group advantages over the whole batch."""
    import subprocess
    import sys

    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_ranks_script.py")
    buf, out = str(tmp_path / "buf"), tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                          "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
                          script, untrained_tiny, buf, str(out), "dapo"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["processes"], r["backend"]) for r in ranks] == [(0, 2, "gloo"), (1, 2, "gloo")]
    assert ranks[0]["run_id"] == ranks[1]["run_id"] == "ranks"
    rows = {r["rollout_id"]: r for r in rollouts(buf)}
    with Buffer.open(buf) as b, b.snapshot() as snap:
        sel = snap.arrow("selections").to_table().to_pylist()
        curations = snap.arrow("curations").to_table(columns=["curation_id"]).column("curation_id").to_pylist()
        curated = {c["rollout_id"]: c for c in snap.arrow("curated").to_table().to_pylist()}
        shards = len(b.manifest.shards("rollouts"))
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == 2 and shards == 2
    seen = []
    for step in range(2):
        batch = [ranks[0]["batches"][step], ranks[1]["batches"][step]]
        ids = batch[0]["ids"] + batch[1]["ids"]
        assert len(ids) == 12 and {rows[i]["step"] for i in ids} == {step}
        seen += ids
        # both processes count the same items: the curated tokens of the whole batch
        kept = sum(sum(b["kept_tokens"]) for b in batch)
        assert batch[0]["num_items"] == batch[1]["num_items"] == kept
        for b in batch:
            for rid, adv, k, comp in zip(b["ids"], b["advantages"], b["kept_tokens"], b["completion_ids"]):
                assert rows[rid]["response_token_ids"] == comp  # the process's own completion, recorded
                c = curated.get(rid)
                assert k == (0 if c is None else sum(c["loss_mask"]))
                trl_adv = json.loads(rows[rid]["meta"])["trl_advantage"]
                assert adv == 0.0 if c is None else abs(adv - trl_adv) <= 1e-5 * max(1.0, abs(trl_adv))
    assert sorted(seen) == sorted(rows) and len(seen) == len(set(seen)) == 24  # every completion exactly once
    straddle = {}
    for r in rows.values():
        straddle.setdefault(r["group_id"], set()).add(json.loads(r["meta"])["trl_process"])
    assert any(len(p) == 2 for p in straddle.values())  # a group split over the two processes is one group
    assert ranks[0]["curations"] == ranks[1]["curations"] == curations and len(curations) == 2
    assert len(sel) == 24 and {s["curation_id"] for s in sel} == set(curations)
