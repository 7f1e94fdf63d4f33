"""Numeric options of every command are checked before anything runs (issue 24, items 2, 11, 12, 13),
and every usage error is one line.

The checks enumerate the commands of the real app: a new numeric option without a rule fails
`test_every_numeric_option_has_a_rule`, and every rule is exercised through the command line."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import typing

import pytest

from conftest import ROLLSTORE_BIN
from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer


def one_error_line(res) -> str:
    assert res.code != 0, (res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert lines[0].startswith("error:"), lines[0]
    return lines[0]


def _base(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return args[0]
    if typing.get_origin(hint) in (list, typing.List):
        return args[0]
    return hint


def numeric_options():
    """(command name, option flag, rule, type) for every int/float option of every command."""
    from rollstore.cli import app

    found = []
    for info in app.registered_commands:
        fn = info.callback
        name = info.name or fn.__name__.rstrip("_").replace("_", "-")
        hints = typing.get_type_hints(fn)
        for pname, p in inspect.signature(fn).parameters.items():
            if _base(hints.get(pname)) not in (int, float):
                continue
            default = p.default
            flags = [d for d in (getattr(default, "param_decls", None) or ()) if d.startswith("--")]
            callback = getattr(default, "callback", None)
            found.append((name, flags[0] if flags else pname, getattr(callback, "rule", None),
                          _base(hints[pname]).__name__))
    return found


REQUIRED = {  # what each command needs besides the option under test (never reached: parsing fails first)
    "init": ["B"], "import": ["B", "f.jsonl"], "export": ["B", "--to", "D"], "sql": ["B", "SELECT 1"],
    "info": ["B"], "gc": ["B"], "verify": ["B"], "compact": ["B"], "curate": ["B", "--recipe", "grpo"],
    "audit": ["B"], "report": ["B", "--out", "r.html"], "generate": ["B"], "train": ["B"], "loop": ["B"],
    "eval": [], "demo": ["B"], "recipes": [], "compare": ["B", "run-a", "run-b"],
}


def test_every_numeric_option_has_a_rule():
    options = numeric_options()
    assert len(options) >= 35, options  # the enumeration finds them
    missing = [(c, o) for c, o, rule, _ in options if rule is None]
    assert not missing, f"numeric options without a rule (rollstore/cli/options.py): {missing}"


@pytest.mark.parametrize("command,flag,rule,kind", numeric_options(),
                         ids=lambda v: v if isinstance(v, str) and v not in ("int", "float") else "")
def test_nonsense_numbers_are_refused_on_every_option(cli, tmp_path, command, flag, rule, kind, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = ["nan", "inf", "-inf"] + (["99999999999999999999", "1.5"] if kind == "int" else [])
    if rule.low is not None:
        bad.append(str(int(rule.low) - 1) if rule.low == int(rule.low) and not rule.low_open else str(rule.low))
    if rule.high is not None:
        bad.append(repr(float(rule.high) * 10 + 10))
    for value in bad:
        res = cli(command, *REQUIRED[command], f"{flag}={value}")
        line = one_error_line(res)
        assert flag in line, line
        assert res.code == 2
    assert not os.path.exists(tmp_path / "B")  # nothing was created, opened or committed


def test_usage_errors_are_one_line(cli):
    for args in (["sql"], ["train", "B", "--bogus"], ["report", "B"], ["train", "B", "--loss", "bogus"],
                 ["train", "B", "--parallel", "mpi"], ["eval", "--k", "0,8"], ["eval", "--k", "x"]):
        line = one_error_line(cli(*args))
        assert "unexpected" not in line, line


@pytest.fixture
def curated(tmp_path, cli):
    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        buf.append_rollouts(rollouts_table(n_groups=6, group_size=4, step=0, policy_version=0, seed=3))
    res = cli("curate", root, "--recipe", "grpo")
    assert res.code == 0, res.stderr
    return root


@pytest.mark.parametrize("args", [["--epochs", "0"], ["--epochs", "-1"], ["--micro-batch-size", "0"],
                                  ["--grad-accum", "0"], ["--lr", "nan"], ["--lr", "-1e-5"], ["--loss", "bogus"],
                                  ["--poll", "0"]])
def test_nonsense_training_options_commit_nothing(cli, curated, args):
    with Buffer.open(curated) as buf:
        seq = buf.manifest.latest_seq()
        leases = buf.manifest.con.execute("SELECT count(*) FROM leases").fetchone()[0]
    line = one_error_line(cli("train", curated, *args))
    assert args[0] in line
    with Buffer.open(curated) as buf:
        assert buf.manifest.latest_seq() == seq  # no checkpoint, no ledger
        assert buf.manifest.con.execute("SELECT count(*) FROM leases").fetchone()[0] == leases


def test_huge_snapshot_number_is_one_line(cli, curated):
    for command in (["curate", curated, "--recipe", "grpo"], ["sql", curated, "SELECT 1"], ["report", curated, "--out", "x.html"]):
        line = one_error_line(cli(*command, "--snapshot", "99999999999999999999"))
        assert "--snapshot" in line and "unexpected" not in line


def test_sql_timeout_beyond_a_timer_is_refused_without_a_thread_traceback(curated):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([ROLLSTORE_BIN, "sql", curated, "--timeout", "1e308", "SELECT 1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "Exception in thread" not in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "--timeout" in res.stderr
    res = subprocess.run([ROLLSTORE_BIN, "sql", curated, "--timeout", "1e9", "SELECT 1 AS x", "--format", "csv"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ['"x"', "1"] and not res.stderr, res.stderr


def test_session_deadline_beyond_a_timer_never_fires(curated):
    from rollstore.queries.session import Session, SqlTimeout

    with Buffer.open(curated) as buf, buf.snapshot() as snap, Session(snap) as session:
        with session.deadline(1e308):
            assert session.one("SELECT 42")[0] == 42
        with pytest.raises(SqlTimeout):
            with session.deadline(float("nan")):
                pass


@pytest.mark.parametrize("command", [["sql", "B", "SELECT 1"], ["curate", "B", "--recipe", "grpo"]])
@pytest.mark.parametrize("value", ["abc", "1KB", "0.0000001B", "99999999999999999999TB", "nanGB", "-1GB"])
def test_memory_limits_out_of_range_are_usage_errors(cli, tmp_path, monkeypatch, command, value):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(cli(*command, "--memory-limit", value))
    assert "--memory-limit" in line and "unexpected" not in line


def test_transformers_progress_bars_are_off_whatever_was_imported_first():
    """The command line's stderr carries one line: transformers' progress bars are off even when transformers was
    imported before rollstore's CLI (a notebook, an earlier test), when the environment variables come too late."""
    code = ("import transformers; import rollstore.cli.commands; "
            "from transformers.utils import logging; print(logging.is_progress_bar_enabled())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS",
                                                                                 "TRANSFORMERS_VERBOSITY")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
