"""Every option checked before anything slow or written (issue 46, point 6): did-you-mean for built-in
names, greso without a pool, the loop's shown defaults, --version, export's error naming the user's path."""

from __future__ import annotations

import os
import re

import pytest


def one_line(res) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.code != 0 and len(lines) == 1 and lines[0].startswith("error:"), (res.code, res.stderr)
    return lines[0]


@pytest.mark.parametrize("args, needle", [
    (["--recipe", "greso", "--pool-size", "0"], "prompt_skip=greso needs a prompt pool"),
    (["--prompts", "builtin:carry"], "no such built-in task (did you mean 'builtin:carries'?)"),
    (["--prompts", "builtin:arith:hardr"], "(did you mean 'builtin:arith:harder'?)"),
    (["--model", "builtin:tinyy"], "no such built-in policy (did you mean 'builtin:tiny'?)"),
    (["--prompts", "no-such-prompts.jsonl"], "--prompts no-such-prompts.jsonl: no such file"),
    (["--recipe", "gerso"], "did you mean 'greso'"),
])
def test_the_loop_refuses_before_it_creates_the_buffer(cli, tmp_path, args, needle):
    root = tmp_path / "lb2"
    line = one_line(cli("loop", root, *args))
    assert needle in line, line
    assert not os.path.exists(root)


def test_generate_refuses_a_misspelt_builtin_before_loading_anything(cli, tmp_path, monkeypatch):
    import rollstore.builtin.resolve as resolve

    root = tmp_path / "b"
    assert cli("init", root).code == 0
    monkeypatch.setattr(resolve, "build_tiny_cached", lambda *a, **k: pytest.fail("a model was built"))
    line = one_line(cli("generate", root, "--prompts", "builtin:carry"))
    assert "did you mean 'builtin:carries'" in line
    assert not [f for _, _, files in os.walk(root) for f in files if f.endswith(".parquet")]


def test_loop_help_shows_the_defaults_it_uses(cli):
    from rollstore.loop.driver import LoopConfig

    text = re.sub(r"[│\s]+", " ", cli("loop", "--help").stdout)
    cfg = LoopConfig(buffer="b")
    for flag, value in (("--iterations", cfg.iterations), ("--prompts-per-iter", cfg.prompts_per_iter),
                        ("--pool-size", cfg.pool_size), ("--group-size", cfg.generation.group_size),
                        ("--max-new-tokens", cfg.generation.max_new_tokens), ("--loss", cfg.train.loss),
                        ("--warmup-steps", cfg.train.warmup_steps), ("--micro-batch-size", cfg.train.micro_batch_size),
                        ("--grad-accum", cfg.train.grad_accum), ("--max-gen-batches", cfg.max_gen_batches),
                        ("--eval-every", cfg.eval_every), ("--eval-prompts", cfg.eval_prompts),
                        ("--backend", cfg.generation.backend)):
        after = text.split(flag + " ", 1)[1].split(" --", 1)[0]
        assert f"[default: ({value})]" in after, (flag, value, after)  # click shows a given default in ()
    assert cfg.max_policy_lag is None and cfg.run_name == f"loop-{cfg.recipe}-s{cfg.seed}"


def test_version(cli):
    import rollstore

    res = cli("--version")
    assert res.code == 0 and res.stdout.strip() == f"rollstore {rollstore.__version__}"


def test_export_to_a_place_it_cannot_write_names_the_users_path(cli, tmp_path, monkeypatch):
    import rollstore.output.export as export

    root = tmp_path / "b"
    assert cli("init", root).code == 0

    def denied(target):
        raise PermissionError(13, "Permission denied", os.path.join(os.path.dirname(target), ".x.partial-h-1-ab"))

    monkeypatch.setattr(export, "partial_dir", denied)
    to = str(tmp_path / "out")
    line = one_line(cli("export", root, "--to", to))
    assert f"--to {to}: cannot write there (Permission denied)" in line and ".partial" not in line
    assert not os.path.exists(to)


def test_docs_python_documents_snapshots_and_batch_shapes():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "python.md")) as fh:
        text = fh.read()
    assert "snapshot=S" in text and "buf.curate(\"d3s\", snapshot=3)" in text
    assert "positions[b, t]" in text and "`input_ids` `[8, 11]`" in text


def test_the_loop_display_keeps_iteration_0_and_wraps_its_legend():
    import io

    from rich.console import Console

    from rollstore.loop.driver import LoopConfig
    from rollstore.loop.view import _table, legend

    cfg = LoopConfig(buffer="b", recipe="grpo")
    evals = [(i, i, 0.2 + i / 100) for i in range(0, 41, 5)]
    title = str(_table(cfg, [], evals).title)
    assert title.startswith("grpo: held-out greedy it 0: 20.0%  …") and title.endswith("it 40: 60.0%")
    out = io.StringIO()
    Console(file=out, width=40, soft_wrap=True).print(legend(cfg), highlight=False, markup=False, soft_wrap=True)
    assert out.getvalue().strip() == legend(cfg)  # one line, not cut at the console's width


def test_report_y_ticks_stay_short_and_one_run_keeps_its_colour():
    from rollstore.report.page import Result, run_colours
    from rollstore.report.svg import tick_text

    assert [tick_text(v) for v in (0.0, 0.25, 1200.0, 9000.0, 12000.0, 1_500_000.0)] == \
        ["0", "0.25", "1200", "9000", "12k", "1.5M"]
    assert all(len(tick_text(float(v))) <= 5 for v in range(0, 2_000_000, 7919))
    res = {"report_training": Result("report_training", "", [{"run_id": "b"}]),
           "report_accuracy_by_step": Result("report_accuracy_by_step", "", [{"run_id": "a"}, {"run_id": "b"}])}
    colours = run_colours(res)
    assert colours["b"] == run_colours({**res, "report_training": Result("report_training", "", [])})["b"]


def test_top_level_help_lists_each_command_in_unbroken_sentences(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    text = cli("--help").stdout
    assert any("per file. With --from, convert another framework's dump (docs/importers.md); importing" in line
               for line in text.splitlines()), text
    assert any("compare" in line and "Two runs side by side" in line for line in text.splitlines())


def test_shell_completion_is_offered(cli):
    res = cli("--show-completion", "bash")  # (the in-process runner names the program `root`)
    assert res.code == 0 and "COMPLETE=complete_bash" in res.stdout and "complete -o default -F" in res.stdout
