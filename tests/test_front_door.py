"""The Python front door (`import rollstore as rs`, docs/python.md) and the command line's fixes of
issue 34, each through its real call path: errors with the command line's text, the shared defaults,
one curation's rows read alone, `why`, `compare`, batches, CSV quoting, `python -m rollstore`,
did-you-mean, `train` with nothing curated, the docs' recipe tables."""

from __future__ import annotations

import csv
import inspect
import io
import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pytest

import rollstore as rs
from rollstore.storage.buffer import Buffer
from rollstore.builtin.synthetic import rollouts_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def two_recipes(tmp_path):
    """A buffer of 12 synthetic groups × 8, curated by d3s (progress 0.3) and by dapo."""
    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        buf.append_rollouts(rollouts_table(n_groups=12, group_size=8, seed=3, run_id="fd"))
    handle = rs.open(root)
    d3s = handle.curate("d3s", progress=0.3)
    dapo = handle.curate("dapo")
    return handle, d3s, dapo


def clipped(text: str) -> str:
    from rollstore.cli.commands import one_line as cli_line

    return cli_line(text)


def one_line(res) -> str:
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert res.code != 0 and len(lines) == 1, (res.code, res.stderr)
    return lines[0].removeprefix("error: ")


# ---- the handle ---------------------------------------------------------------------------------


def test_open_create_and_repr(tmp_path):
    with pytest.raises(rs.NotABuffer) as exc:
        rs.open(tmp_path / "nope")
    assert "rollstore init" in str(exc.value) and "create=True" in str(exc.value)
    buf = rs.open(tmp_path / "new", create=True)
    assert repr(buf).startswith("<rollstore.Buffer") and "0 rollouts" in repr(buf) and "\n" not in repr(buf)
    assert rs.open(tmp_path / "new") == buf


def test_sql_has_the_cli_views_macros_and_sandbox(two_recipes, tmp_path):
    buf, _, _ = two_recipes
    res = buf.sql("SELECT count(*) AS n, accuracy_band_key(0.3) AS band FROM groups")
    assert res.pl().to_dicts() == [{"n": 12, "band": "3 acc [.25, .5)"}]
    assert isinstance(res.arrow(), pa.Table) and res.df().shape == (1, 2)
    assert "1 rows × 2 columns" in repr(res)
    with pytest.raises(rs.SqlRefused):
        buf.sql(f"COPY rollouts TO '{tmp_path / 'x.csv'}'")
    with pytest.raises(rs.SqlError, match='Did you mean "rollouts"'):
        buf.sql("SELECT * FROM rollout")


def test_errors_have_the_command_lines_text(two_recipes, cli):
    buf, _, _ = two_recipes
    cases = [
        (lambda: buf.curate("DAPO"), ("curate", buf.root, "--recipe", "DAPO"), rs.UnknownRecipe, "did you mean 'dapo'?"),
        (lambda: buf.curate("d3s", progres=0.3), ("curate", buf.root, "--recipe", "d3s", "--set", "progres=0.3"),
         rs.UnknownParameter, "did you mean 'progress'?"),
        (lambda: buf.sql("SELECT * FROM rollout"), ("sql", buf.root, "SELECT * FROM rollout"), rs.SqlError,
         'Did you mean "rollouts"?'),
        (lambda: buf.curation("cur-nope"), ("audit", buf.root, "cur-nope"), rs.UnknownCuration, "no curation 'cur-nope'"),
    ]
    for call, argv, kind, text in cases:
        with pytest.raises(kind) as exc:
            call()
        line = one_line(cli(*argv))
        assert text in str(exc.value) and clipped(str(exc.value)) == line  # the CLI clips at 500 characters


def test_a_curation_of_another_buffer_is_refused(two_recipes, tmp_path, cli):
    buf, d3s, _ = two_recipes
    other = rs.open(tmp_path / "other", create=True)
    with pytest.raises(rs.RollstoreError, match="belongs to the buffer"):
        other.train(d3s)
    with pytest.raises(rs.UnknownCuration) as exc:
        other.train(d3s.id)
    assert str(exc.value) == one_line(cli("train", other.root, "--curation", d3s.id))


def test_curation_handle_reads_its_own_rows_only(two_recipes, monkeypatch):
    buf, d3s, dapo = two_recipes
    with Buffer.open(buf.root) as b, b.snapshot() as snap:
        everything = snap.curated().to_pylist()
        selections = snap.arrow("selections").to_table().to_pylist()
    fresh = buf.curation(d3s.id)
    import rollstore.storage.references as refs

    resolved = []
    real = refs.resolve
    monkeypatch.setattr(refs, "resolve", lambda t, *a, **k: resolved.append(set(t.column("curation_id").to_pylist()))
                        or real(t, *a, **k))
    rows = fresh.curated
    assert resolved and all(ids == {d3s.id} for ids in resolved)  # filtered before references are resolved
    assert rows.to_dicts() == [r for r in everything if r["curation_id"] == d3s.id]
    assert sorted(fresh.audit["rollout_id"]) == sorted(s["rollout_id"] for s in selections if s["curation_id"] == d3s.id)
    summary = fresh.summary.to_dicts()[0]
    assert summary["n_selected"] == rows.height and summary["recipe"] == "d3s"
    assert dict(zip(fresh.reasons["reason"], fresh.reasons["candidates"])) == d3s._result.reasons
    assert "d3s" in repr(fresh) and "\n" not in repr(fresh)


def test_compare_is_the_audit_compare_data(two_recipes, cli):
    buf, d3s, dapo = two_recipes
    cmp = d3s.compare(dapo)
    doc = json.loads(cli("audit", buf.root, d3s.id, "--compare", dapo.id, "-f", "json").stdout)
    for name in ("summary", "params", "reasons", "differences"):
        got = json.loads(json.dumps(getattr(cmp, name).to_dicts(), default=str))
        assert len(got) == len(doc[name]) and {json.dumps(r, sort_keys=True, default=str) for r in got} == \
            {json.dumps(r, sort_keys=True, default=str) for r in doc[name]} or name == "summary"
    assert cmp.summary["side"].to_list() == ["A", "B"]


def test_why_ranks_a_dropped_rollout_against_the_budget_and_cut_offs(two_recipes, cli):
    buf, d3s, _ = two_recipes
    audit = d3s.audit
    pool = audit.filter(audit["reason"].is_in(["selected", "not_selected"])).sort(
        ["advantage_final", "rollout_id"], descending=[True, False])
    dropped = pool.filter(pool["reason"] == "not_selected")["rollout_id"][0]
    why = d3s.why(dropped)
    order = pool["rollout_id"].to_list()
    assert why.reason == "not_selected" and not why.selected
    assert why.pool_position == order.index(dropped) + 1 and why.pool_size == pool.height
    assert why.budget == int((pool["reason"] == "selected").sum()) == d3s.summary["n_selected"][0]
    kept = pool.filter(pool["reason"] == "selected")["advantage_final"].to_list()
    assert all(v >= why.keep_at_or_above or v <= why.keep_at_or_below for v in kept)
    assert why.keep_at_or_below <= why.selection_value <= why.keep_at_or_above  # ties go by rollout_id
    assert why.prompt and why.gold_answer is not None and why.tokens.height == audit.filter(
        audit["rollout_id"] == dropped)["tokens_total"][0]
    assert "ranks" in why.explain() and str(why.budget) in why.explain()
    doc = json.loads(cli("audit", buf.root, d3s.id, "--rollout", dropped, "-f", "json").stdout)
    assert (doc["pool_position"], doc["budget"], doc["gold_answer"]) == (why.pool_position, why.budget, why.gold_answer)
    table = cli("audit", buf.root, d3s.id, "--rollout", dropped).stdout
    assert f"ranks {why.pool_position} of {why.pool_size}" in table and "gold answer" in table


def test_batches_yield_the_curations_rows_as_tensors(two_recipes):
    import torch

    _, d3s, _ = two_recipes
    batches = list(d3s.batches(16))
    assert sum(b.input_ids.shape[0] for b in batches) == d3s.curated.height
    assert all(isinstance(b.advantage, torch.Tensor) and b.loss_mask.dtype == torch.bool for b in batches)
    assert [r for b in batches for r in b.rollout_ids] == d3s.curated["rollout_id"].to_list()


def test_dry_run_handle(two_recipes):
    buf, _, _ = two_recipes
    dry = buf.curate("grpo", dry_run=True)
    assert not dry.committed and dry.summary["n_candidates"][0] == 96
    with pytest.raises(rs.RollstoreError, match="dry run"):
        dry.curated  # noqa: B018


def test_defaults_are_shared_with_the_command_line():
    """Every option of generate/train/curate/sql that the front door takes has one default."""
    import typer.main

    from rollstore.cli import app
    from rollstore.rules.defaults import CURATE, GENERATE, SQL, TRAIN
    from rollstore.handle import Buffer as Handle

    group = typer.main.get_command(app)
    for command, defaults, method in (("generate", GENERATE, Handle.generate), ("train", TRAIN, Handle.train),
                                      ("curate", CURATE, Handle.curate), ("sql", SQL, Handle.sql)):
        params = {p.name: p.default for p in group.commands[command].params}
        keywords = inspect.signature(method).parameters
        for field, value in vars(defaults).items():
            assert params[field] == value, (command, field)
            assert keywords[field].default == value, (command, field)
    from rollstore.rules.defaults import train_config

    assert (train_config().lr, train_config().micro_batch_size) == (2e-5, 64)


def test_every_public_name_has_a_docstring():
    missing = []
    for name in rs.__all__:
        obj = getattr(rs, name)
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                target = member.fget if isinstance(member, property) else member
                if callable(target) and not (inspect.getdoc(target) or "").strip():
                    missing.append(f"{name}.{attr}")
    assert not missing, missing
    assert "may change without notice" in " ".join(rs.__doc__.split())


# ---- the command line's fixes -------------------------------------------------------------------


def test_sql_csv_quotes_only_what_needs_quotes(two_recipes, cli):
    buf, _, _ = two_recipes
    out = cli("sql", buf.root, "SELECT rollout_id, 'a,b' AS x, 2 AS n FROM rollouts ORDER BY rollout_id LIMIT 2",
              "-f", "csv").stdout
    lines = out.splitlines()
    assert lines[0] == "rollout_id,x,n" and lines[1].startswith("fd-") and lines[1].endswith(',"a,b",2')
    assert [r["x"] for r in csv.DictReader(io.StringIO(out))] == ["a,b", "a,b"]
    rid = lines[1].split(",")[0]  # an id piped into the next command works as is
    assert cli("sql", buf.root, f"SELECT count(*) FROM rollouts WHERE rollout_id = '{rid}'", "-f", "csv"
               ).stdout.splitlines()[1] == "1"


def test_python_dash_m_rollstore():
    res = subprocess.run([sys.executable, "-m", "rollstore", "recipes"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "d3s" in res.stdout


def test_recipes_list_aligns_long_names(cli):
    lines = cli("recipes").stdout.splitlines()
    assert any(line.startswith("replay-rollouts-x3 ") for line in lines)
    starts = {re.search(r"\S+\s+", line).end() for line in lines if line.strip()}
    assert len(starts) == 1  # every description starts in the same column


def test_train_with_nothing_curated_is_one_line(buffer_dir, cli):
    with Buffer.open(buffer_dir) as buf:
        buf.append_rollouts(rollouts_table(n_groups=2, group_size=4, seed=1))
    line = one_line(cli("train", buffer_dir, "--model", "builtin:tiny"))
    assert line.startswith("nothing to train") and "rollstore curate" in line
    with pytest.raises(rs.RollstoreError) as exc:
        rs.open(buffer_dir).train()
    assert str(exc.value) == line


def test_snapshot_table_typo_is_one_line(two_recipes):
    buf, _, _ = two_recipes
    with Buffer.open(buf.root) as b, b.snapshot() as snap:
        with pytest.raises(rs.UnknownName, match="did you mean 'selections'"):
            snap.polars("selection")


def test_docs_recipe_tables_list_every_recipe():
    from rollstore.curate.params import builtin_recipes

    with open(os.path.join(ROOT, "docs", "recipes.md"), encoding="utf-8") as fh:
        recipes_md = fh.read()
    with open(os.path.join(ROOT, "docs", "replay.md"), encoding="utf-8") as fh:
        replay_md = fh.read()
    for name in builtin_recipes():
        assert f"| `{name}` |" in recipes_md, name
        if name.startswith("replay-"):
            assert f"| `{name}` |" in replay_md, name


# ---- with the built-in policy -------------------------------------------------------------------

from rollout_helpers import default_tiny, tiny_cache  # noqa: E402,F401  (fixtures)


def test_generate_from_a_checkpoint_stamps_its_version(buffer_dir, cli, default_tiny):  # noqa: F811
    small = ("--num-prompts", "8", "--group-size", "4", "--max-new-tokens", "4")
    assert cli("generate", buffer_dir, "--model", default_tiny, *small).code == 0
    assert cli("curate", buffer_dir, "--recipe", "grpo").code == 0
    assert cli("train", buffer_dir, "--model", default_tiny).code == 0
    res = cli("generate", buffer_dir, "--model", os.path.join(buffer_dir, "checkpoints", "v1"), *small)
    assert res.code == 0 and "policy v1" in res.stderr
    got = rs.open(buffer_dir).sql("SELECT step, min(policy_version), max(policy_version) FROM rollouts "
                                  "GROUP BY step ORDER BY step").fetchall()
    assert got == [(0, 0, 0), (1, 1, 1)]
    assert cli("generate", buffer_dir, "--model", os.path.join(buffer_dir, "checkpoints", "v1"), *small,
               "--policy-version", "7").code == 0  # an explicit version still wins
    assert rs.open(buffer_dir).sql("SELECT max(policy_version) FROM rollouts WHERE step = 2").fetchall() == [(7,)]


def test_first_build_of_the_builtin_policy_says_so(buffer_dir, cli, tmp_path, monkeypatch):
    import rollstore.builtin.shipped as shipped
    import rollstore.learner.tiny as tiny

    monkeypatch.setenv("ROLLSTORE_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", str(tmp_path / "nothing-shipped"))  # a build, not a copy

    def stop(*args, **kwargs):
        raise RuntimeError("stopped by the test once the build began")

    monkeypatch.setattr(tiny, "build_tiny", stop)
    res = cli("generate", buffer_dir, "--num-prompts", "2")
    assert res.code != 0 and "stopped by the test" in res.stderr
    first = res.stderr.strip().splitlines()[0]
    assert first.startswith("builtin:tiny: building the built-in policy once") and "minutes" in first


def test_docs_python_md_has_nine_jobs_of_at_most_three_lines():
    with open(os.path.join(ROOT, "docs", "python.md"), encoding="utf-8") as fh:
        text = fh.read()
    jobs = text.split("## The nine jobs", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", jobs, re.DOTALL)
    assert len(blocks) == 9
    assert all(len([x for x in b.splitlines() if x.strip()]) <= 3 for b in blocks), blocks


def test_storage_objects_have_short_reprs(two_recipes):
    buf, _, _ = two_recipes
    with Buffer.open(buf.root) as b, b.snapshot(pin=True) as snap:
        assert repr(b) == f"<storage.Buffer {buf.root!r}>"
        assert repr(snap).startswith("<Snapshot") and "pinned" in repr(snap) and "\n" not in repr(snap)


def test_a_curation_results_repr_leaves_out_its_tables(two_recipes):
    buf, _, _ = two_recipes
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate

    with Buffer.open(buf.root) as b:
        result = curate(b, load_recipe("grpo"), {}, dry_run=True)
    assert result.audit is not None and "audit" not in repr(result) and len(repr(result)) < 2000


def test_curate_takes_a_recipe_file_and_keyword_parameters(two_recipes, tmp_path, cli):
    buf, _, _ = two_recipes
    recipe = tmp_path / "half.toml"
    recipe.write_text('description = "dapo, then half of the pool"\n[params]\nfilter = "dynamic"\n'
                      'sample = "cross_group"\n')
    cur = buf.curate(str(recipe), sample_fraction=0.5, where="step = 0")
    assert cur.recipe == "half" and cur.params["sample_fraction"] == 0.5 and cur.params["where"] == "step = 0"
    out = cli("curate", buf.root, "--recipe", str(recipe), "--set", "sample_fraction=0.5", "--set", "where=step = 0",
              "--snapshot", str(cur.record["snapshot_seq"]))
    assert out.code == 0 and out.stdout.strip().splitlines()[-1] == cur.id  # the same curation either way
    assert "already committed" in out.stdout
