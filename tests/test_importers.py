"""Importers of other frameworks' dumps (issue 16 item 2): `rollstore import BUFFER FILE --from FMT`.

Each fixture is written the way that project's writer writes it (see each importer's docstring):
TRL's pandas `to_parquet` of its completion log, verl's `json.dumps(..., ensure_ascii=False)` lines,
prime-rl's compact `json.dumps(..., separators=(",", ":"))` token export records, NeMo-RL's one
object per sample. The `--tokenizer` is the tiny character tokenizer; `--score-model` a randomly
initialised tiny model (only its being a causal LM matters)."""

from __future__ import annotations

import json

import duckdb
import pandas as pd
import pytest

from storage.buffer import Buffer

EOS = 2  # the tiny tokenizer's eos id (SPECIALS = pad, bos, eos, unk)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from learner.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    from transformers import LlamaForCausalLM

    from learner.tiny import build_tokenizer, tiny_model_config

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


def trl_run(out, conversational: bool, steps: int = 1, logging_steps: int = 1, steps_per_generation=None):
    """Run TRL's GRPOTrainer with log_completions=True; return the sorted completion files."""
    pytest.importorskip("trl")
    import glob

    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from learner.tiny import build_tokenizer, tiny_model_config

    def length_reward(completions, **kw):
        return [float(len(c if isinstance(c, str) else c[0]["content"]) % 2) for c in completions]

    def constant(completions, **kw):
        return [None if i == 0 else 0.5 for i in range(len(completions))]  # None: TRL logs NaN

    tok = build_tokenizer()
    tok.chat_template = CHAT
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_model_config(tok))
    texts = ["1+1=", "2*3="]
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
    from learner.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("chat-tok")
    tok = build_tokenizer()
    tok.chat_template = CHAT
    tok.save_pretrained(str(path))
    return str(path)


def test_trl_completions_from_a_real_grpo_trainer(tmp_path, cli, buf, tok_dir, model_dir):
    (f,) = trl_run(tmp_path / "out", conversational=False)
    table = pd.read_parquet(f)
    assert list(table.columns) == ["step", "prompt", "completion", "length_reward", "constant", "advantage"]
    res = cli("import", buf, f, "--from", "trl-completions", "--tokenizer", tok_dir, "--score-model", model_dir)
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
    # None from a reward function is NaN in TRL's file; it adds nothing to the reward and is null in meta
    first = [r for r in rows if json.loads(r["meta"])["rewards"]["constant"] is None]
    assert len(first) == 1 and first[0]["reward"] == json.loads(first[0]["meta"])["rewards"]["length_reward"]
    notes = shard_notes(buf)
    assert [(n["format"], n["file"], n["rows"]) for n in notes] == [("trl-completions", "completions_00001.parquet", 8)]
    again = cli("import", buf, f, "--from", "trl-completions", "--tokenizer", tok_dir, "--score-model", model_dir)
    assert again.code == 0 and "0 new rows" in again.stdout


def test_trl_conversational_from_a_real_grpo_trainer(tmp_path, cli, buf, chat_tok_dir, model_dir):
    """Conversational dataset: TRL logs prompts and completions as lists of messages; the prompt is
    rendered with the tokenizer's chat template as TRL rendered it before sampling."""
    (f,) = trl_run(tmp_path / "out", conversational=True)
    logged = pd.read_parquet(f)
    assert isinstance(logged["prompt"][0][0], dict)  # a list of messages, as TRL logs it
    res = cli("import", buf, f, "--from", "trl-completions", "--tokenizer", chat_tok_dir, "--score-model", model_dir)
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


def tok_dir_plain(tmp_path):
    from learner.tiny import build_tokenizer

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
    res = cli("import", buf, f1, f2, "--from", "trl-completions", "--tokenizer", tok_dir, "--score-model", model_dir)
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
    """As RayPPOTrainer._dump_generations writes {rollout_data_dir}/{step}.jsonl."""
    n = len(entries["input"])
    path = folder / f"{step}.jsonl"
    lines = [json.dumps({k: v[i] for k, v in entries.items()}, ensure_ascii=False) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_verl_jsonl(tmp_path, cli, buf, tok_dir, model_dir):
    f = verl_file(tmp_path, 3, {"input": ["1+2="] * 2 + ["4-1="] * 2, "output": ["3", "4", "3", "3"],
                                "gts": ["3", "3", "3", "3"], "score": [1.0, 0.0, 1.0, 1.0],
                                "step": [3] * 4, "acc": [True, False, True, True]})
    res = cli("import", buf, f, "--from", "verl-jsonl", "--tokenizer", tok_dir, "--score-model", model_dir)
    assert res.code == 0, res.stderr
    rows = rows_of(buf, "prompt, sample_idx")
    assert [(r["prompt"], r["response"], r["reward"], r["correct"], r["gold_answer"]) for r in rows] == [
        ("1+2=", "3", 1.0, True, "3"), ("1+2=", "4", 0.0, False, "3"), ("4-1=", "3", 1.0, True, "3"),
        ("4-1=", "3", 1.0, True, "3")]
    assert len({r["group_id"] for r in rows}) == 2 and {r["policy_version"] for r in rows} == {3}
    assert "group rebuilt from order" in rows[0]["meta"]
    again = cli("import", buf, f, "--from", "verl-jsonl", "--tokenizer", tok_dir, "--score-model", model_dir)
    assert again.code == 0 and "0 new rows" in again.stdout and len(rows_of(buf)) == 4


def test_verl_uid_groups_and_missing_score(tmp_path, cli, buf, tok_dir, model_dir):
    f = verl_file(tmp_path, 1, {"input": ["1+2=", "4-1=", "1+2="], "output": ["3", "3", "4"],
                                "score": [1.0, 1.0, 0.0], "step": [1] * 3, "uid": ["a", "b", "a"]})
    assert cli("import", buf, f, "--from", "verl-jsonl", "--tokenizer", tok_dir, "--score-model", model_dir).code == 0
    rows = rows_of(buf, "prompt, sample_idx")
    assert rows[0]["group_id"] == rows[1]["group_id"] != rows[2]["group_id"]
    bad = verl_file(tmp_path, 2, {"input": ["1+2="], "output": ["3"], "step": [2]})
    line = one_error_line(cli("import", buf, bad, "--from", "verl-jsonl", "--tokenizer", tok_dir, "--score-model", model_dir))
    assert "verl-jsonl" in line and bad in line and "score" in line


# ---- prime-rl -------------------------------------------------------------------------------
def prime_record(step: int, idx: int, prompt: list[int], resp: list[int], reward: float, adv: float) -> dict:
    n_p, n = len(prompt), len(prompt) + len(resp)
    return {"schema_version": 2, "step": step, "export_step": step, "rank": 0, "micro_step": 0,
            "micro_sequence_idx": idx, "export_sequence_idx": idx, "preflight_only": False,
            "sample_id": f"s{idx}", "run_id": None, "env_name": "arith",
            "token_ids": prompt + resp, "position_ids": list(range(n)),
            "loss_mask": [False] * n_p + [True] * len(resp), "temperatures": [1.0] * n,
            "advantages": [0.0] * n_p + [adv] * len(resp), "rewards": [reward] * n,
            "inference_logprobs": [0.0] * n_p + [-0.5] * len(resp),
            "trainer_logprobs": [0.0] * n_p + [-0.25] * len(resp),
            "entropy": [0.0] * n_p + [1.5] * len(resp)}


def prime_file(folder, step: int, records: list[dict]) -> str:
    """As TokenExporter._write appends to token_exports/step_{N}/rank_{R}.jsonl."""
    d = folder / "token_exports" / f"step_{step}"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "rank_0.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n")
    return str(path)


def test_prime_rl(tmp_path, cli, buf, tok_dir):
    p1, p2 = [1, 5, 14, 5, 18], [1, 6, 15, 5, 18]  # <bos>1+1=  <bos>2-1=
    recs = [prime_record(4, 0, p1, [6, EOS], 1.0, 0.5), prime_record(4, 1, p2, [5, EOS], 1.0, 0.5),
            prime_record(4, 2, p1, [7, 7, 7], 0.0, -0.5), prime_record(4, 3, p2, [5, EOS], 1.0, 0.5)]
    f = prime_file(tmp_path, 4, recs)
    res = cli("import", buf, f, "--from", "prime-rl", "--tokenizer", tok_dir)
    assert res.code == 0, res.stderr
    rows = rows_of(buf, "rollout_id")
    assert len(rows) == 4 and len({r["group_id"] for r in rows}) == 2
    by_resp = {tuple(r["response_token_ids"]): r for r in rows}
    long = by_resp[(7, 7, 7)]
    assert long["finish_reason"] == "length" and long["reward"] == 0.0 and long["response"] == "333"
    assert long["gen_logprobs"] == [-0.5] * 3 and long["old_logprobs"] == [-0.25] * 3
    assert long["entropies"] == [1.5] * 3 and long["prompt"] == "1+1=" and long["source"] == "arith"
    assert json.loads(long["meta"])["advantages"] == [-0.5] * 3
    assert by_resp[(6, EOS)]["finish_reason"] == "stop"
    again = cli("import", buf, f, "--from", "prime-rl", "--tokenizer", tok_dir)
    assert again.code == 0 and "0 new rows" in again.stdout and len(rows_of(buf)) == 4


def test_prime_rl_refusals(tmp_path, cli, buf, tok_dir):
    rec = prime_record(1, 0, [1, 5], [6, EOS], 1.0, 0.0)
    rec["rewards"] = None
    f = prime_file(tmp_path, 1, [rec])
    line = one_error_line(cli("import", buf, f, "--from", "prime-rl", "--tokenizer", tok_dir))
    assert "prime-rl" in line and f in line and "reward" in line
    gap = prime_record(2, 0, [1, 5], [6, 6, EOS], 1.0, 0.0)
    gap["loss_mask"][3] = False
    f2 = prime_file(tmp_path, 2, [gap])
    line = one_error_line(cli("import", buf, f2, "--from", "prime-rl", "--tokenizer", tok_dir))
    assert f2 in line and "loss_mask" in line and "multi-turn" in line
    assert rows_of(buf) == []


# ---- NeMo-RL --------------------------------------------------------------------------------
def nemo_file(folder, step: int, samples: list[tuple[list[int], list[int], float]], pad_to: int = 10) -> str:
    """As grpo_train logs through Logger.log_batched_dict_as_jsonl: one object per sample, per-token
    lists over the padded sequence."""
    log_data: dict[str, list] = {k: [] for k in ("token_ids", "input_lengths", "token_loss_mask",
                                                 "generation_logprobs", "prev_logprobs", "advantages",
                                                 "rewards", "sample_loss_mask")}
    for prompt, resp, reward in samples:
        n = len(prompt) + len(resp)
        pad = pad_to - n
        log_data["token_ids"].append(prompt + resp + [0] * pad)
        log_data["input_lengths"].append(n)
        log_data["token_loss_mask"].append([0] * len(prompt) + [1] * len(resp) + [0] * pad)
        log_data["generation_logprobs"].append([0.0] * len(prompt) + [-0.75] * len(resp) + [0.0] * pad)
        log_data["prev_logprobs"].append([0.0] * len(prompt) + [-0.7] * len(resp) + [0.0] * pad)
        log_data["advantages"].append([reward - 0.5] * (n + pad))
        log_data["rewards"].append(reward)
        log_data["sample_loss_mask"].append(1.0)
    path = folder / f"train_data_step{step}.jsonl"
    with path.open("w") as fh:
        for i in range(len(samples)):
            fh.write(json.dumps({k: v[i] for k, v in log_data.items()}) + "\n")
    return str(path)


def test_nemo_rl(tmp_path, cli, buf, tok_dir):
    p1, p2 = [1, 5, 14, 5, 18], [1, 6, 15, 5, 18]
    f = nemo_file(tmp_path, 7, [(p1, [6, EOS], 1.0), (p1, [7, EOS], 0.0), (p2, [5, EOS], 1.0), (p2, [5], 1.0)])
    res = cli("import", buf, f, "--from", "nemo-rl", "--tokenizer", tok_dir)
    assert res.code == 0, res.stderr
    rows = rows_of(buf, "prompt, sample_idx")
    assert [(r["prompt"], r["response"], r["reward"], r["finish_reason"]) for r in rows] == [
        ("1+1=", "2", 1.0, "stop"), ("1+1=", "3", 0.0, "stop"), ("2-1=", "1", 1.0, "stop"), ("2-1=", "1", 1.0, "length")]
    assert {r["step"] for r in rows} == {7} and len({r["group_id"] for r in rows}) == 2
    assert rows[0]["gen_logprobs"] == [-0.75, -0.75] and rows[0]["old_logprobs"] == [pytest.approx(-0.7)] * 2
    assert rows[0]["entropies"] is None
    assert json.loads(rows[0]["meta"])["advantages"] == [0.5, 0.5]
    again = cli("import", buf, f, "--from", "nemo-rl", "--tokenizer", tok_dir)
    assert again.code == 0 and "0 new rows" in again.stdout and len(rows_of(buf)) == 4


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
    assert "nemo-rl" in line and f in line and "gen_logprobs" in line
    line = one_error_line(cli("import", buf, f, "--from", "other-rl"))
    assert "unknown format" in line
    assert rows_of(buf) == []
