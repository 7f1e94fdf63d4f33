"""Importers of other frameworks' dumps (issue 16 item 2): `rollstore import BUFFER FILE --from FMT`.

Each fixture is written the way that project's writer writes it (see each importer's docstring):
TRL's pandas `to_parquet` of its completion log, verl's `json.dumps(..., ensure_ascii=False)` lines,
prime-rl's compact `json.dumps(..., separators=(",", ":"))` token export records, NeMo-RL's one
object per sample. The `--tokenizer` is the tiny character tokenizer; `--score-model` a randomly
initialised tiny model (only its being a causal LM matters)."""

from __future__ import annotations

import json
import os

import duckdb
import pandas as pd
import pytest

from rollstore.storage.buffer import Buffer

EOS = 2  # the tiny tokenizer's eos id (SPECIALS = pad, bos, eos, unk)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from rollstore.learner.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    from transformers import LlamaForCausalLM

    from rollstore.learner.tiny import build_tokenizer, tiny_model_config

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model")
    LlamaForCausalLM(tiny_model_config(build_tokenizer())).save_pretrained(str(path))
    return str(path)


@pytest.fixture
def buf(tmp_path, cli):
    root = str(tmp_path / "buf")
    assert cli("init", root).code == 0
    return root


def rows_of(root: str, order: str = "step, group_id, sample_idx") -> list[dict]:
    with Buffer.open(root) as b, b.snapshot() as snap:
        con = duckdb.connect()
        snap.register_duckdb(con, ["rollouts"])
        return con.sql(f"SELECT * FROM rollouts ORDER BY {order}").to_arrow_table().to_pylist()


def shard_notes(root: str) -> list[dict]:
    """The `rollstore.import` key-value metadata of each rollouts shard's Parquet file, read with
    plain pyarrow (manifest order)."""
    import os

    import pyarrow.parquet as pq

    with Buffer.open(root) as b:
        paths = [os.path.join(root, s.path) for s in b.manifest.shards("rollouts")]
    return [json.loads(pq.read_schema(p).metadata[b"rollstore.import"]) for p in paths]


def one_error_line(res) -> str:
    assert res.code != 0, (res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    return lines[0]


# ---- TRL ------------------------------------------------------------------------------------
# The fixtures are written by TRL itself: a real `GRPOTrainer(log_completions=True)` (TRL 1.16) on the
# untrained tiny Llama, CPU, one step; `GRPOTrainer.log` writes completions/completions_00001.parquet.
CHAT = ("{% for m in messages %}({{ m['content'] }}){% endfor %}{% if add_generation_prompt %}={% endif %}")


def trl_run(out, conversational: bool, steps: int = 1, logging_steps: int = 1, steps_per_generation=None,
            texts=("1+1=", "2*3=")):
    """Run TRL's GRPOTrainer with log_completions=True; return the sorted completion files."""
    pytest.importorskip("trl")
    import glob

    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from rollstore.learner.tiny import build_tokenizer, tiny_model_config

    def length_reward(completions, **kw):
        return [float(len(c if isinstance(c, str) else c[0]["content"]) % 2) for c in completions]

    def constant(completions, **kw):
        return [None if i == 0 else 0.5 for i in range(len(completions))]  # None: TRL logs NaN

    tok = build_tokenizer()
    tok.chat_template = CHAT
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_model_config(tok))
    rows = ([{"prompt": [{"role": "user", "content": t}]} for t in texts] if conversational
            else [{"prompt": t} for t in texts])
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = GRPOConfig(output_dir=str(out), num_generations=4, per_device_train_batch_size=8, max_completion_length=4,
                         max_steps=steps, learning_rate=1e-3, logging_steps=logging_steps, report_to=[],
                         save_strategy="no", use_cpu=True, seed=0, log_completions=True, dataloader_num_workers=0,
                         disable_tqdm=True, **({"steps_per_generation": steps_per_generation} if steps_per_generation else {}))
        GRPOTrainer(model=model, reward_funcs=[length_reward, constant], args=cfg,
                    train_dataset=Dataset.from_list(rows), processing_class=tok).train()
    finally:
        torch.set_num_threads(old)
    return sorted(glob.glob(str(out / "completions" / "completions_*.parquet")))


@pytest.fixture(scope="module")
def chat_tok_dir(tmp_path_factory):
    from rollstore.learner.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("chat-tok")
    tok = build_tokenizer()
    tok.chat_template = CHAT
    tok.save_pretrained(str(path))
    return str(path)


def test_trl_completions_from_a_real_grpo_trainer(tmp_path, cli, buf, tok_dir, model_dir):
    (f,) = trl_run(tmp_path / "out", conversational=False)
    table = pd.read_parquet(f)
    assert list(table.columns) == ["step", "prompt", "completion", "length_reward", "constant", "advantage"]
    res = cli("import", buf, f, "--from", "trl-completions", "--correct-threshold", "1", "--tokenizer", tok_dir, "--score-model", model_dir)
    assert res.code == 0, res.stderr
    rows = rows_of(buf)
    assert len(rows) == len(table) == 8  # every logged completion, repeated ones included
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    assert sorted(len(g) for g in groups.values()) == [4, 4]
    assert all(len({r["prompt"] for r in g}) == 1 for g in groups.values())
    assert {r["step"] for r in rows} == {1}
    assert sorted(r["response"] for r in rows) == sorted(table["completion"])
    # the prompt ids TRL fed the model: processing_class(text=...) adds the tokenizer's BOS (id 1)
    assert {tuple(r["prompt_token_ids"]) for r in rows} == {(1, 5, 14, 5, 18), (1, 6, 16, 7, 18)}
    # None from a reward function is NaN in TRL's file; it adds nothing to the reward and is null in meta
    first = [r for r in rows if json.loads(r["meta"])["rewards"]["constant"] is None]
    assert len(first) == 1 and first[0]["reward"] == json.loads(first[0]["meta"])["rewards"]["length_reward"]
    notes = shard_notes(buf)
    assert [(n["format"], n["file"], n["rows"]) for n in notes] == [("trl-completions", "completions_00001.parquet", 8)]
    again = cli("import", buf, f, "--from", "trl-completions", "--correct-threshold", "1", "--tokenizer", tok_dir, "--score-model", model_dir)
    assert again.code == 0 and "0 new rows" in again.stdout


def test_trl_conversational_from_a_real_grpo_trainer(tmp_path, cli, buf, chat_tok_dir, model_dir):
    """Conversational dataset: TRL logs prompts and completions as lists of messages; the prompt is
    rendered with the tokenizer's chat template as TRL rendered it before sampling."""
    (f,) = trl_run(tmp_path / "out", conversational=True)
    logged = pd.read_parquet(f)
    assert isinstance(logged["prompt"][0][0], dict)  # a list of messages, as TRL logs it
    res = cli("import", buf, f, "--from", "trl-completions", "--correct-threshold", "1", "--tokenizer", chat_tok_dir, "--score-model", model_dir)
    assert res.code == 0, res.stderr
    rows = rows_of(buf)
    assert len(rows) == 8 and {r["prompt"] for r in rows} == {"(1+1=)=", "(2*3=)="}
    one = [r for r in rows if r["prompt"] == "(1+1=)="]
    assert len(one) == 4 and all(r["prompt_token_ids"] == [19, 5, 14, 5, 18, 20, 18] for r in one)
    by_msg = sorted(r["response"] for r in rows)
    assert by_msg == sorted(m[0]["content"] for m in logged["completion"])
    assert "chat template" in rows[0]["meta"]
    # a tokenizer without a chat template cannot render the conversation: one line, row and field
    line = one_error_line(cli("import", buf, f, "--from", "trl-completions", "--tokenizer", str(tok_dir_plain(tmp_path)),
                              "--score-model", model_dir))
    assert "trl-completions" in line and f in line and "row 0" in line and "'prompt'" in line and "chat template" in line


def test_trl_batch_logged_twice_by_a_real_grpo_trainer(tmp_path, cli, buf, tok_dir, model_dir):
    """steps_per_generation=2, logging_steps=1: TRL writes a file at steps 1 and 2 from the same deques,
    both holding the one generation batch of 16; importing both adds it once."""
    files = trl_run(tmp_path / "out", conversational=False, steps=2, steps_per_generation=2,
                    texts=("1+1=", "2*3=", "4-2=", "9/3="))
    assert [os.path.basename(f) for f in files] == ["completions_00001.parquet", "completions_00002.parquet"]
    a, b = pd.read_parquet(files[0]), pd.read_parquet(files[1])
    assert len(a) == len(b) == 16 and list(a["completion"]) == list(b["completion"])
    res = cli("import", buf, *files, "--from", "trl-completions", "--correct-threshold", "1", "--tokenizer", tok_dir, "--score-model", model_dir)
    assert res.code == 0, res.stderr
    assert "16 new rows" in res.stdout and "0 new rows, 16 already present" in res.stdout
    rows = rows_of(buf)
    assert len(rows) == 16 and sorted(len([r for r in rows if r["group_id"] == g]) for g in {r["group_id"] for r in rows}) == [4] * 4


def tok_dir_plain(tmp_path):
    from rollstore.learner.tiny import build_tokenizer

    path = tmp_path / "plain-tok"
    build_tokenizer().save_pretrained(str(path))
    return path


def trl_file(folder, step: int, prompts: list, completions: list, correct: list[float], name=None):
    """A table with the columns GRPOTrainer.log writes (step, prompt, completion, one column per reward
    function, advantage), written with pandas `to_parquet` as TRL does."""
    (folder / "completions").mkdir(exist_ok=True)
    adv = [c - sum(correct) / len(correct) for c in correct] if correct else []
    df = pd.DataFrame({"step": [step] * len(prompts), "prompt": prompts, "completion": completions,
                       "correctness_reward": correct, "format_reward": [0.5] * len(prompts), "advantage": adv})
    path = folder / "completions" / (name or f"completions_{step:05d}.parquet")
    df.to_parquet(path)
    return str(path)


def test_trl_repeated_completions_are_kept(tmp_path, cli, buf, tok_dir, model_dir):
    """Identical completions of one prompt are distinct rows (content + occurrence within the group);
    the same generation batch logged again in the next file adds nothing."""
    g1 = (["1+1="] * 4, ["2", "3", "2", "2"], [1.0, 0.0, 1.0, 1.0])
    g2 = (["2*3="] * 4, ["6", "5", "6", "6"], [1.0, 0.0, 1.0, 1.0])
    f1 = trl_file(tmp_path, 10, g1[0] + g2[0], g1[1] + g2[1], g1[2] + g2[2])
    # steps_per_generation > logging_steps: the deques still hold the same batch at the next log
    f2 = trl_file(tmp_path, 11, g1[0] + g2[0], g1[1] + g2[1], g1[2] + g2[2])
    res = cli("import", buf, f1, f2, "--from", "trl-completions", "--correct-threshold", "1", "--tokenizer", tok_dir, "--score-model", model_dir)
    assert res.code == 0, res.stderr
    rows = rows_of(buf)
    assert len(rows) == 8 and len({r["rollout_id"] for r in rows}) == 8
    assert [(r["prompt"], r["response"], r["sample_idx"]) for r in rows if r["prompt"] == "1+1="] == [
        ("1+1=", "2", 0), ("1+1=", "3", 1), ("1+1=", "2", 2), ("1+1=", "2", 3)]
    assert rows[0]["reward"] == pytest.approx(1.5) and rows[1]["reward"] == pytest.approx(0.5)
    assert "0 new rows, 8 already present" in res.stdout
    meta = json.loads(rows[0]["meta"])
    assert meta["rewards"] == {"correctness_reward": 1.0, "format_reward": 0.5}
    assert any("retokenised" in x for x in meta["import"]["lossy"])
    notes = shard_notes(buf)
    assert [(n["format"], n["file"], n["rows"]) for n in notes] == [("trl-completions", "completions_00010.parquet", 8)]
    assert all(any("group rebuilt from order" in x for x in n["lossy"]) for n in notes)


def test_trl_refusals_name_format_file_row_and_field(tmp_path, cli, buf, tok_dir, model_dir):
    f1 = trl_file(tmp_path, 1, ["1+1="] * 2, ["2", "3"], [1.0, 0.0])
    line = one_error_line(cli("import", buf, f1, "--from", "trl-completions"))
    assert "trl-completions" in line and f1 in line and "prompt_token_ids" in line
    line = one_error_line(cli("import", buf, f1, "--from", "trl-completions", "--tokenizer", tok_dir))
    assert "trl-completions" in line and f1 in line and "gen_logprobs" in line
    args = ("--from", "trl-completions", "--tokenizer", tok_dir, "--score-model", model_dir)
    nul = trl_file(tmp_path, 2, ["1+1=", None], ["2", "3"], [1.0, 0.0])
    line = one_error_line(cli("import", buf, nul, *args))
    assert line == f"error: trl-completions: {nul}: row 1: field 'prompt': expected a string or a list of messages, got null None"
    num = trl_file(tmp_path, 3, ["1+1="] * 2, [2, 3], [1.0, 0.0])
    line = one_error_line(cli("import", buf, num, *args))
    assert "trl-completions" in line and num in line and "row 0" in line and "'completion'" in line
    zero = trl_file(tmp_path, 4, [], [], [])
    line = one_error_line(cli("import", buf, zero, *args))
    assert line == f"error: trl-completions: {zero}: the file is empty (no rows to import)"
    assert rows_of(buf) == []


# ---- verl -----------------------------------------------------------------------------------
def verl_file(folder, step: int, entries: dict[str, list]) -> str:
    """Transcribes verl b178a3cd, verl/trainer/ppo/ray_trainer.py, RayPPOTrainer._dump_generations:
    base_data = input, output, gts, score, step (+ reward extra infos of one value per sample); one
    json.dumps(entry, ensure_ascii=False) per sample; "\n".join(lines) + "\n" to {rollout_data_dir}/{step}.jsonl."""
    n = len(entries["input"])
    path = folder / f"{step}.jsonl"
    lines = [json.dumps({k: v[i] for k, v in entries.items()}, ensure_ascii=False) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def balance_batch_order(outputs: list[str]) -> list[int]:
    """A stand-in for verl's default `trainer.balance_batch: True` (`_balance_batch` reorders the batch
    by sequence length over the data-parallel ranks before the dump): an order by length that puts
    a prompt's samples far apart."""
    return sorted(range(len(outputs)), key=lambda i: (len(outputs[i]), i % 4, i))


def test_verl_default_settings_balance_batch_groups_by_step_and_prompt(tmp_path, cli, buf, tok_dir, model_dir):
    """verl's defaults: balance_batch on, no uid logged, the default (float) reward: no extra keys.
    4 prompts x 4 samples, reordered; the import finds 4 groups of 4 (not 16 of 1), and dapo keeps
    the groups whose outcomes differ."""
    prompts = ["1+2=", "4-1=", "2*2=", "9-8="]
    gold = ["3", "3", "4", "1"]
    outs = [["3", "33", "3", "4"], ["3", "3", "3", "3"], ["4", "44", "5", "4"], ["1", "0", "11", "1"]]
    flat = [(p, o, g) for p, os_, g in zip(prompts, outs, gold) for o in os_]
    order = balance_batch_order([o for _, o, _ in flat])
    flat = [flat[i] for i in order]
    assert [p for p, _, _ in flat[:4]] != [flat[0][0]] * 4  # not adjacent any more
    f = verl_file(tmp_path, 5, {"input": [p for p, _, _ in flat], "output": [o for _, o, _ in flat],
                                "gts": [g for _, _, g in flat], "score": [float(o == g) for _, o, g in flat],
                                "step": [5] * len(flat)})
    res = cli("import", buf, f, "--from", "verl-jsonl", "--tokenizer", tok_dir, "--score-model", model_dir,
              "--correct-threshold", "1")
    assert res.code == 0, res.stderr
    rows = rows_of(buf, "prompt, sample_idx")
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4, 4]
    assert all(len({r["prompt"] for r in g}) == 1 for g in groups.values())
    assert "group rebuilt from (step, input)" in rows[0]["meta"]
    assert cli("curate", buf, "--recipe", "dapo").code == 0
    sel = json.loads(cli("sql", buf, "SELECT reason, count(*) AS n FROM selections GROUP BY 1 ORDER BY 1", "-f", "json").stdout)
    assert {d["reason"]: d["n"] for d in sel} == {"selected": 12, "zero_variance": 4}
    again = cli("import", buf, f, "--from", "verl-jsonl", "--correct-threshold", "1", "--tokenizer", tok_dir, "--score-model", model_dir)
    assert again.code == 0 and "0 new rows" in again.stdout and len(rows_of(buf)) == 16


def test_verl_reward_extra_keys_and_uid_groups(tmp_path, cli, buf, tok_dir, model_dir):
    """A reward function returning a dict (score, acc, pred) adds its keys; a uid, where logged, groups."""
    f = verl_file(tmp_path, 3, {"input": ["1+2="] * 2 + ["4-1="] * 2, "output": ["3", "4", "3", "3"],
                                "gts": ["3", "3", "3", "3"], "score": [1.0, 0.0, 1.0, 1.0],
                                "step": [3] * 4, "acc": [True, False, True, True], "pred": ["3", "4", "3", "3"]})
    res = cli("import", buf, f, "--from", "verl-jsonl", "--correct-threshold", "1", "--tokenizer", tok_dir, "--score-model", model_dir)
    assert res.code == 0, res.stderr
    rows = rows_of(buf, "prompt, sample_idx")
    assert [(r["prompt"], r["response"], r["reward"], r["correct"], r["gold_answer"]) for r in rows] == [
        ("1+2=", "3", 1.0, True, "3"), ("1+2=", "4", 0.0, False, "3"), ("4-1=", "3", 1.0, True, "3"),
        ("4-1=", "3", 1.0, True, "3")]
    assert len({r["group_id"] for r in rows}) == 2 and {r["policy_version"] for r in rows} == {3}
    assert json.loads(rows[0]["meta"])["pred"] == "3"
    f2 = verl_file(tmp_path, 1, {"input": ["1+2=", "4-1=", "1+2="], "output": ["3", "3", "4"], "gts": [None] * 3,
                                 "score": [1.0, 1.0, 0.0], "step": [1] * 3, "uid": ["a", "b", "a"]})
    assert cli("import", buf, f2, "--from", "verl-jsonl", "--correct-threshold", "1", "--tokenizer", tok_dir, "--score-model", model_dir).code == 0
    rows = [r for r in rows_of(buf, "prompt, sample_idx") if r["step"] == 1]
    assert rows[0]["group_id"] == rows[1]["group_id"] != rows[2]["group_id"] and rows[0]["gold_answer"] is None


def test_verl_refusals(tmp_path, cli, buf, tok_dir, model_dir):
    args = ("--from", "verl-jsonl", "--tokenizer", tok_dir, "--score-model", model_dir)
    bad = verl_file(tmp_path, 2, {"input": ["1+2="], "output": ["3"], "gts": ["3"], "step": [2]})
    line = one_error_line(cli("import", buf, bad, *args))
    assert line == f"error: verl-jsonl: {bad}: line 1: field 'score (reward)': missing required field"
    wrong = verl_file(tmp_path, 3, {"input": ["1+2="], "output": [None], "gts": ["3"], "score": [1.0], "step": [3]})
    line = one_error_line(cli("import", buf, wrong, *args))
    assert line == f"error: verl-jsonl: {wrong}: line 1: field 'output': expected text, got null None"
    (tmp_path / "4.jsonl").write_text("")
    line = one_error_line(cli("import", buf, str(tmp_path / "4.jsonl"), *args))
    assert line == f"error: verl-jsonl: {tmp_path / '4.jsonl'}: the file is empty (no rows to import)"
    assert rows_of(buf) == []


# ---- prime-rl -------------------------------------------------------------------------------
def prime_record(step: int, rank: int, idx: int, prompt: list[int], resp: list[int], adv: float,
                 rewards: float | None = None, old_writer: bool = False) -> dict:
    """One record as prime-rl 289562d2e writes it (src/prime_rl/trainer/rl/token_export.py,
    TokenExporter.export + _export_columns + _slice_columns): schema_version 1, the record key, then
    the per-token columns over prompt + completion (diagnostics null: no DefaultLossConfig masks).
    `old_writer`: the layout before 0be5ac452 (e971d905a..fa21395a6): `training_mode` and a per-token
    `rewards` list."""
    n_p, n = len(prompt), len(prompt) + len(resp)
    rec = {"schema_version": 1, "step": step, "rank": rank, "micro_step": 0, "micro_sequence_idx": idx,
           "export_sequence_idx": idx, "env_name": "arith"}
    if old_writer:
        rec["training_mode"] = "rl"
    rec.update({"token_ids": prompt + resp, "position_ids": list(range(n)),
                "loss_mask": [False] * n_p + [True] * len(resp), "advantages": [0.0] * n_p + [adv] * len(resp)})
    if old_writer:
        rec["rewards"] = [rewards] * n
    rec.update({"inference_logprobs": [0.0] * n_p + [-0.5] * len(resp),
                "trainer_logprobs": [0.0] * n_p + [-0.25] * len(resp), "entropy": [0.0] * n_p + [1.5] * len(resp)})
    for k in ("mismatch_kl", "log_importance_ratio", "importance_ratio", "prob_delta", "is_masked", "is_masked_high",
              "is_masked_low"):
        rec[k] = [None] * n
    if not old_writer:
        for k in ("rl_weights", "ce_weights", "ref_kl_weights"):
            rec[k] = [None] * n
    return rec


def prime_file(folder, step: int, records: list[dict], rank: int = 0, stable: bool = True) -> str:
    """As TokenExporter._write appends to token_exports/step_{N}/rank_{R}.jsonl (mark_stable: STABLE)."""
    d = folder / "token_exports" / f"step_{step}"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"rank_{rank}.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n")
    if stable:
        (d / "STABLE").touch()
    return str(path)


P1, P2 = [1, 5, 14, 5, 18], [1, 6, 15, 5, 18]  # <bos>1+1=  <bos>2-1=


def test_prime_rl_groups_across_rank_files_with_rewards_file(tmp_path, cli, buf, tok_dir):
    """The current writer (no rewards) with data parallelism: each group's samples are split over
    rank_0 and rank_1. Rewards come from --rewards, keyed by the record key or by token_ids."""
    r0 = [prime_record(4, 0, 0, P1, [6, EOS], 0.5), prime_record(4, 0, 1, P2, [5, EOS], 0.5)]
    r1 = [prime_record(4, 1, 0, P1, [7, 7, 7], -0.5), prime_record(4, 1, 1, P2, [5, EOS], 0.5)]
    f0, f1 = prime_file(tmp_path, 4, r0, rank=0), prime_file(tmp_path, 4, r1, rank=1)
    line = one_error_line(cli("import", buf, f0, "--from", "prime-rl", "--tokenizer", tok_dir))
    assert line.startswith(f"error: prime-rl: {f0}: line 1: field 'reward': this export holds no rewards") and "--rewards" in line
    rewards = tmp_path / "rewards.jsonl"
    rewards.write_text("\n".join(json.dumps(x) for x in [
        {"step": 4, "rank": 0, "export_sequence_idx": 0, "reward": 1.0},
        {"step": 4, "rank": 0, "export_sequence_idx": 1, "reward": 1.0},
        {"step": 4, "token_ids": P1 + [7, 7, 7], "reward": 0.0},
        {"token_ids": P2 + [5, EOS], "reward": 1.0}]) + "\n")
    res = cli("import", buf, f0, f1, "--from", "prime-rl", "--correct-threshold", "1", "--tokenizer", tok_dir, "--rewards", str(rewards))
    assert res.code == 0, res.stderr
    assert res.stdout.count("new rows") == 1  # one step directory, imported once
    rows = rows_of(buf, "rollout_id")
    assert len(rows) == 4
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    assert sorted(len(g) for g in groups.values()) == [2, 2]
    assert all(len({json.loads(r["meta"])["export"]["rank"] for r in g}) == 2 for g in groups.values())
    by_resp = {tuple(r["response_token_ids"]): r for r in rows}
    long = by_resp[(7, 7, 7)]
    assert long["finish_reason"] == "length" and long["reward"] == 0.0 and long["response"] == "333"
    assert long["gen_logprobs"] == [-0.5] * 3 and long["old_logprobs"] == [-0.25] * 3
    assert long["entropies"] == [1.5] * 3 and long["prompt"] == "1+1=" and long["source"] == "arith"
    assert json.loads(long["meta"])["advantages"] == [-0.5] * 3
    assert by_resp[(6, EOS)]["finish_reason"] == "stop" and by_resp[(6, EOS)]["reward"] == 1.0
    assert "reward taken from the --rewards file" in long["meta"]
    again = cli("import", buf, os.path.dirname(f0), "--from", "prime-rl", "--correct-threshold", "1", "--tokenizer", tok_dir, "--rewards", str(rewards))
    assert again.code == 0 and "0 new rows" in again.stdout and len(rows_of(buf)) == 4


def test_prime_rl_older_writer_with_rewards(tmp_path, cli, buf, tok_dir):
    """Writers before 0be5ac452 export a per-token `rewards` list: no --rewards needed."""
    recs = [prime_record(2, 0, i, P1, resp, 0.0, rewards=rw, old_writer=True)
            for i, (resp, rw) in enumerate([([6, EOS], 1.0), ([7, EOS], 0.0)])]
    f = prime_file(tmp_path, 2, recs, stable=False)
    res = cli("import", buf, f, "--from", "prime-rl", "--correct-threshold", "1", "--tokenizer", tok_dir)
    assert res.code == 0, res.stderr
    rows = rows_of(buf, "sample_idx")
    assert [r["reward"] for r in rows] == [1.0, 0.0] and len({r["group_id"] for r in rows}) == 1
    assert "no STABLE marker" in rows[0]["meta"]


def test_prime_rl_refusals(tmp_path, cli, buf, tok_dir):
    args = ("--from", "prime-rl", "--tokenizer", tok_dir)
    rec = prime_record(1, 0, 0, [1, 5], [6, EOS], 0.0, rewards=1.0, old_writer=True)
    rec["token_ids"] = None
    f = prime_file(tmp_path, 1, [rec])
    line = one_error_line(cli("import", buf, f, *args))
    assert line == f"error: prime-rl: {f}: line 1: field 'token_ids': expected a non-empty list of token ids, got null None"
    rec = prime_record(2, 0, 0, [1, 5], [6, EOS], 0.0, rewards=1.0, old_writer=True)
    rec["token_ids"][2] = 6.5
    f = prime_file(tmp_path, 2, [rec])
    line = one_error_line(cli("import", buf, f, *args))
    assert line == f"error: prime-rl: {f}: line 1: field 'token_ids': expected non-negative integer token ids, found a number 6.5"
    gap = prime_record(3, 0, 0, [1, 5], [6, 6, EOS], 1.0, rewards=1.0, old_writer=True)
    gap["loss_mask"][3] = False
    f = prime_file(tmp_path, 3, [gap])
    line = one_error_line(cli("import", buf, f, *args))
    assert f"prime-rl: {f}: line 1: field 'loss_mask'" in line and "multi-turn" in line
    f = prime_file(tmp_path, 5, [])
    line = one_error_line(cli("import", buf, f, *args))
    assert line == f"error: prime-rl: {f}: the file is empty (no rows to import)"
    assert rows_of(buf) == []


# ---- NeMo-RL --------------------------------------------------------------------------------
def nemo_file(folder, step: int, samples: list[tuple[list[int], list[int], float]], pad_to: int = 10,
              dynamic_sampling: bool = False) -> str:
    """Transcribes NeMo-RL 7ea279ab: grpo_train's Logging block (nemo_rl/algorithms/grpo.py) builds
    log_data = content, rewards, input_lengths, token_ids, token_loss_mask, sample_loss_mask,
    advantages, generation_logprobs, prev_logprobs (padded to the batch's longest sequence), and
    Logger.log_batched_dict_as_jsonl (nemo_rl/utils/logger.py) writes one line per
    make_microbatch_iterator(1) slice: every value a batch of one, plus "idx"."""
    log_data: dict[str, list] = {"content": [], "rewards": []}
    if dynamic_sampling:
        log_data["filtered_rewards"] = []
    log_data.update({k: [] for k in ("input_lengths", "token_ids", "token_loss_mask", "sample_loss_mask",
                                     "advantages", "generation_logprobs", "prev_logprobs")})
    for prompt, resp, reward in samples:
        n = len(prompt) + len(resp)
        pad = pad_to - n
        log_data["content"].append(["user text", "assistant text"])
        log_data["rewards"].append(reward)
        if dynamic_sampling:
            log_data["filtered_rewards"].append(reward)
        log_data["input_lengths"].append(n)
        log_data["token_ids"].append(prompt + resp + [0] * pad)
        log_data["token_loss_mask"].append([0] * len(prompt) + [1] * len(resp) + [0] * pad)
        log_data["sample_loss_mask"].append(1.0)
        log_data["advantages"].append([reward - 0.5] * (n + pad))
        log_data["generation_logprobs"].append([0.0] * len(prompt) + [-0.75] * len(resp) + [0.0] * pad)
        log_data["prev_logprobs"].append([0.0] * len(prompt) + [-0.7] * len(resp) + [0.0] * pad)
    path = folder / f"train_data_step{step}.jsonl"
    with path.open("w") as fh:
        for i in range(len(samples)):
            sample = {k: v[i:i + 1] for k, v in log_data.items()}  # BatchedDataDict.slice(i, i + 1)
            fh.write(json.dumps({**sample, "idx": i}, default=str) + "\n")
    return str(path)


def test_nemo_rl(tmp_path, cli, buf, tok_dir):
    p1, p2 = [1, 5, 14, 5, 18], [1, 6, 15, 5, 18]
    f = nemo_file(tmp_path, 7, [(p1, [6, EOS], 1.0), (p1, [7, EOS], 0.0), (p2, [5, EOS], 1.0), (p2, [5], 1.0)])
    assert json.loads(open(f).readline())["rewards"] == [1.0]  # the batch-of-one layout
    res = cli("import", buf, f, "--from", "nemo-rl", "--correct-threshold", "1", "--tokenizer", tok_dir)
    assert res.code == 0, res.stderr
    rows = rows_of(buf, "prompt, sample_idx")
    assert [(r["prompt"], r["response"], r["reward"], r["finish_reason"]) for r in rows] == [
        ("1+1=", "2", 1.0, "stop"), ("1+1=", "3", 0.0, "stop"), ("2-1=", "1", 1.0, "stop"), ("2-1=", "1", 1.0, "length")]
    assert {r["step"] for r in rows} == {7} and len({r["group_id"] for r in rows}) == 2
    assert rows[0]["gen_logprobs"] == [-0.75, -0.75] and rows[0]["old_logprobs"] == [pytest.approx(-0.7)] * 2
    assert rows[0]["entropies"] is None
    meta = json.loads(rows[0]["meta"])
    assert meta["advantages"] == [0.5, 0.5] and meta["idx"] == 0 and meta["sample_loss_mask"] == 1.0
    again = cli("import", buf, f, "--from", "nemo-rl", "--correct-threshold", "1", "--tokenizer", tok_dir)
    assert again.code == 0 and "0 new rows" in again.stdout and len(rows_of(buf)) == 4
    ds = nemo_file(tmp_path, 8, [(p1, [6, EOS], 1.0), (p1, [7, EOS], 0.0)], dynamic_sampling=True)
    assert cli("import", buf, ds, "--from", "nemo-rl", "--correct-threshold", "1", "--tokenizer", tok_dir).code == 0
    assert json.loads(rows_of(buf, "step DESC, sample_idx")[0]["meta"])["filtered_rewards"] == 1.0


def test_correct_threshold_makes_imported_groups_curatable(tmp_path, cli, buf, tok_dir):
    p1 = [1, 5, 14, 5, 18]
    f = nemo_file(tmp_path, 2, [(p1, [6, EOS], 1.0), (p1, [7, EOS], 0.0)])
    assert cli("import", buf, f, "--from", "nemo-rl", "--tokenizer", tok_dir, "--correct-threshold", "0.5").code == 0
    rows = rows_of(buf, "sample_idx")
    assert [r["correct"] for r in rows] == [True, False] and "reward >= 0.5" in rows[0]["meta"]
    (note,) = shard_notes(buf)
    assert note["format"] == "nemo-rl" and note["lossy"] == json.loads(rows[0]["meta"])["import"]["lossy"]
    assert any("reward >= 0.5" in x for x in note["lossy"])
    res = cli("curate", buf, "--recipe", "grpo")
    assert res.code == 0, res.stderr
    sel = cli("sql", buf, "SELECT reason, count(*) AS n FROM selections GROUP BY 1", "-f", "json")
    assert json.loads(sel.stdout) == [{"reason": "selected", "n": 2}]


def test_nemo_rl_refusals(tmp_path, cli, buf, tok_dir):
    f = nemo_file(tmp_path, 1, [([1, 5], [6, EOS], 1.0)])
    line = one_error_line(cli("import", buf, f, "--from", "nemo-rl"))
    assert "nemo-rl" in line and f in line and "prompt" in line
    data = json.loads(open(f).read())
    del data["generation_logprobs"]
    with open(f, "w") as fh:
        fh.write(json.dumps(data) + "\n")
    line = one_error_line(cli("import", buf, f, "--from", "nemo-rl", "--tokenizer", tok_dir))
    assert line == f"error: nemo-rl: {f}: line 1: field 'gen_logprobs (generation_logprobs)': missing required field"
    flat = nemo_file(tmp_path, 2, [([1, 5], [6, EOS], 1.0)])
    data = {k: (v[0] if k != "idx" else v) for k, v in json.loads(open(flat).read()).items()}  # not what NeMo writes
    with open(flat, "w") as fh:
        fh.write(json.dumps(data) + "\n")
    line = one_error_line(cli("import", buf, flat, "--from", "nemo-rl", "--tokenizer", tok_dir))
    assert line.startswith(f"error: nemo-rl: {flat}: line 1: field 'content': expected a batch of one")
    nul = nemo_file(tmp_path, 3, [([1, 5], [6, EOS], 1.0)])
    data = json.loads(open(nul).read())
    data["token_ids"] = [[1, None, 6, EOS]]
    with open(nul, "w") as fh:
        fh.write(json.dumps(data) + "\n")
    line = one_error_line(cli("import", buf, nul, "--from", "nemo-rl", "--tokenizer", tok_dir))
    assert line == f"error: nemo-rl: {nul}: line 1: field 'token_ids': expected non-negative integer token ids, found null None"
    (tmp_path / "train_data_step4.jsonl").write_text("")
    line = one_error_line(cli("import", buf, str(tmp_path / "train_data_step4.jsonl"), "--from", "nemo-rl", "--tokenizer", tok_dir))
    assert line.endswith("train_data_step4.jsonl: the file is empty (no rows to import)")
    line = one_error_line(cli("import", buf, f, "--from", "other-rl"))
    assert "unknown format" in line
    line = one_error_line(cli("import", buf, f, "--from", "nemo-rl", "--tokenizer", tok_dir, "--rewards", f))
    assert line == "error: --rewards is for --from prime-rl (the nemo-rl dump holds its rewards)"
    assert rows_of(buf) == []


def test_no_verdict_without_a_threshold_is_refused_and_a_reimport_cannot_rederive(tmp_path, cli, buf):
    """A file whose format gives no verdict is refused without --correct-threshold (every row would be
    `invalid`), nothing written; a re-import with another threshold is refused (rows are written once);
    `--tokenizer builtin:tiny` is a tokenizer like any other command's model reference."""
    f = trl_file(tmp_path, 1, ["1+1="] * 2, ["2", "3"], [1.0, 0.0])
    args = ("--from", "trl-completions", "--tokenizer", "builtin:tiny", "--score-model", "builtin:tiny")
    line = one_error_line(cli("import", buf, f, *args))
    assert f in line and "no verdict" in line and "--correct-threshold" in line and "nothing was written" in line
    assert rows_of(buf) == []
    res = cli("import", buf, f, *args, "--correct-threshold", "1")
    assert res.code == 0 and "2 new rows" in res.stdout, res.stderr
    assert [r["correct"] for r in rows_of(buf)] == [True, False]
    assert "0 new rows, 2 already present" in cli("import", buf, f, *args, "--correct-threshold", "1").stdout
    line = one_error_line(cli("import", buf, f, *args, "--correct-threshold", "2"))
    assert "already in the buffer with other verdicts" in line and "--correct-threshold 2" in line
    assert "nothing was written" in line
    assert [r["correct"] for r in rows_of(buf)] == [True, False]
