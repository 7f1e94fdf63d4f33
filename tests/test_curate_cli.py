"""Curation through the command line and the Python API: every recipe, the output contract,
determinism, errors, custom SQL and TOML recipes, the audit, and a buffer larger than memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollstore.curate.options import Limits
from rollstore.curate.params import ParamError, load_recipe
from rollstore.curate.run import curate
from rollstore.builtin.synthetic import RowOptions, rollouts_table
from rollstore.storage.buffer import Buffer

RECIPES = ["grpo", "dapo", "da3po", "pods", "d1s", "d1s-c", "d2s", "d3s", "d3s-i", "entropy-top"]
BIN = os.path.join(os.path.dirname(sys.executable), "rollstore")


def run(*args, check=True):
    res = subprocess.run([BIN, *args], capture_output=True, text=True)
    if check:
        assert res.returncode == 0, res.stderr
    return res


def query(cli, root, sql):
    """`rollstore sql ROOT SQL --format json` in-process (the `cli` fixture): the checks of what a
    command run through the real binary wrote, without a process start per check."""
    res = cli("sql", root, sql, "--format", "json")
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cur") / "buf")
    with Buffer.init(root) as buf:
        for v in range(3):
            buf.append_rollouts(rollouts_table(n_groups=12, group_size=8, step=v, policy_version=v, seed=5))
    return root


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_from_the_command_line(filled, recipe, cli):
    res = run("curate", filled, "--recipe", recipe, "--progress", "0.4" if recipe.startswith("d3s") else "0")
    lines = res.stdout.strip().splitlines()
    cid = lines[-1]
    assert cid.startswith("cur-") and " " not in cid
    assert any(line.startswith("candidates") for line in lines)
    assert any(line.startswith("Var(A)") for line in lines)
    (row,) = query(cli, filled, f"SELECT count(*) AS n, count(DISTINCT rollout_id) AS d, "
                                f"sum((reason = 'selected')::INT) AS s FROM selections WHERE curation_id = '{cid}'")
    rec = query(cli, filled, f"SELECT * FROM curations WHERE curation_id = '{cid}'")[0]
    assert row["n"] == row["d"] == rec["n_candidates"] == 96  # one audit row per candidate
    assert row["s"] == rec["n_selected"]
    curated = query(cli, filled, f"SELECT count(*) AS n FROM curated WHERE curation_id = '{cid}'")[0]
    assert curated["n"] == rec["n_selected"]
    assert json.loads(rec["params"])["where"] == "run_id = 'run0' AND step = 2"


def test_repeated_runs_are_byte_identical(tmp_path):
    root = str(tmp_path / "b")
    with Buffer.init(root) as buf:
        buf.append_rollouts(rollouts_table(n_groups=10, group_size=6, seed=9))
        seq = buf.manifest.latest_seq()
        first = curate(buf, load_recipe("d3s"), {"progress": "0.3"}, snapshot_seq=seq)
        files = {p: open(os.path.join(root, p), "rb").read() for p in first.output_files}
        dry = curate(buf, load_recipe("d3s"), {"progress": "0.3"}, snapshot_seq=seq, commit=False)
        assert dry.curation_id == first.curation_id
        assert dry.audit.equals(first.audit)
        committed = pa.concat_tables(pq.read_table(os.path.join(root, p)) for p in first.output_files if p.startswith("curated/"))
        assert dry.curated.equals(committed)
        again = curate(buf, load_recipe("d3s"), {"progress": "0.3"}, snapshot_seq=seq)
        assert again.already_existed and again.curation_id == first.curation_id
        assert {p: open(os.path.join(root, p), "rb").read() for p in first.output_files} == files
        n = buf.snapshot().rows("curations")
        assert n == 1


def test_clear_errors(filled, tmp_path, cli):
    cases = [
        (["--recipe", "nope"], "unknown recipe"),
        (["--recipe", "grpo", "--set", "bogus=1"], "unknown parameter"),
        (["--recipe", "grpo", "--set", "token_fraction=0"], "(0, 1]"),
        (["--recipe", "grpo", "--set", "sample_fraction=1.5"], "(0, 1]"),
        (["--recipe", "grpo", "--set", "progress=0.1", "--progress", "0.2"], "given twice"),
        (["--recipe", "grpo", "--set", "std=1", "--set", "std=2"], "given twice"),
        (["--recipe", "d3s", "--set", "token_fraction=0.5"], "schedule"),
        (["--recipe", "grpo", "--set", "where=step = 1000"], "empty batch"),
        (["--recipe", "grpo", "--set", "where=true); COPY rollouts TO 'x.csv'; SELECT (1"], "not one SQL expression"),
        (["--recipe", "grpo", "--set", "where=1=1; COPY rollouts TO 'x.csv'"], "not one SQL expression"),
    ]
    for n, (args, needle) in enumerate(cases):  # the first through the real binary, the others in-process
        res = run("curate", filled, *args, check=False) if n == 0 else cli("curate", filled, *args)
        code = res.returncode if n == 0 else res.code
        assert code != 0, args
        assert needle in res.stderr, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_token_recipe_without_entropies_names_rollout_and_command(tmp_path):
    root = str(tmp_path / "b")
    with Buffer.init(root) as buf:
        buf.append_rollouts(rollouts_table(n_groups=4, group_size=4, seed=2, options=RowOptions(with_entropies=False)))
        before = buf.manifest.latest_seq()
    res = run("curate", root, "--recipe", "d2s", check=False)
    assert res.returncode != 0
    assert "rollout_id=" in res.stderr and "entropies" in res.stderr and "rollstore generate" in res.stderr
    with Buffer.open(root) as buf:
        assert buf.manifest.latest_seq() == before  # nothing committed
    assert run("curate", root, "--recipe", "d1s-c").returncode == 0  # sample-level recipes still work


def test_pool_emptied_by_filter_commits_empty_run(tmp_path):
    root = str(tmp_path / "b")
    table = rollouts_table(n_groups=3, group_size=4, seed=1, options=RowOptions(p_invalid=0, p_truncated=0))
    table = table.set_column(table.schema.get_field_index("correct"), "correct", pa.array([True] * 12))
    table = table.set_column(table.schema.get_field_index("reward"), "reward", pa.array([1.0] * 12, pa.float32()))
    with Buffer.init(root) as buf:
        buf.append_rollouts(table)
        r = curate(buf, load_recipe("dapo"), {})
    assert r.record["n_selected"] == 0 and r.record["adv_var_before"] is None and r.record["adv_var_after"] is None
    assert r.reasons == {"zero_variance": 12}


def test_custom_sql_recipe(filled, tmp_path, cli):
    good = tmp_path / "pick.sql"
    good.write_text(
        "SELECT rollout_id, advantage, 0.5 AS weight FROM candidates\n"
        "QUALIFY row_number() OVER (PARTITION BY group_id, correct\n"
        "  ORDER BY len(response_token_ids) * (CASE WHEN correct THEN -1 ELSE 1 END), rollout_id) = 1\n"
    )
    res = run("curate", filled, "--recipe", str(good))
    cid = res.stdout.strip().splitlines()[-1]
    rows = query(cli, filled, f"SELECT s.reason, c.weight FROM selections s LEFT JOIN curated c "
                              f"USING (curation_id, rollout_id) WHERE s.curation_id = '{cid}'")
    selected = [r for r in rows if r["reason"] == "selected"]
    assert selected and all(r["weight"] == 0.5 for r in selected)
    assert {r["reason"] for r in rows} <= {"selected", "not_selected", "invalid"}
    for body, needle in [
        ("SELECT 'nope' AS rollout_id, 1.0 AS advantage", "not a candidate"),
        ("SELECT rollout_id, 1.0 AS advantage FROM candidates UNION ALL SELECT rollout_id, 1.0 FROM candidates", "twice"),
        ("SELECT rollout_id, 'NaN'::DOUBLE AS advantage FROM candidates", "finite"),
        ("SELECT rollout_id FROM candidates", "no column 'advantage'"),
        ("COPY (SELECT 1) TO 'x.csv'", "only SELECT"),
    ]:
        bad = tmp_path / "bad.sql"
        bad.write_text(body)
        res = cli("curate", filled, "--recipe", str(bad))
        assert res.code != 0 and needle in res.stderr, (body, res.stderr)


def test_toml_recipe_file(filled, tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('description = "mine"\n[params]\nsample = "cross_group"\nsample_fraction = 0.5\namplify = "group"\n')
    res = run("curate", filled, "--recipe", str(path), "--dry-run")
    assert "kept samples  48" in res.stdout  # round(96 · 0.5)
    with pytest.raises(ParamError):
        load_recipe(str(tmp_path / "missing.toml"))


def test_audit_command(filled, cli):
    cid = run("curate", filled, "--recipe", "d3s", "--progress", "0.2").stdout.strip().splitlines()[-1]
    res = run("audit", filled, cid)
    assert "reasons" in res.stdout and "selected" in res.stdout and "keep rate" in res.stdout
    rid = query(cli, filled, f"SELECT rollout_id FROM selections WHERE curation_id = '{cid}' "
                             "AND selected ORDER BY rollout_id LIMIT 1")[0]["rollout_id"]
    res = run("audit", filled, cid, "--rollout", rid)
    assert "score" in res.stdout and "kept" in res.stdout


def test_user_views(filled):
    groups = json.loads(run("sql", filled, "SELECT sum(size) AS n, count(*) AS g FROM groups", "--format", "json").stdout)[0]
    assert groups == {"n": 288, "g": 36}
    prompts = json.loads(run("sql", filled, "SELECT * FROM prompts ORDER BY prompt_id, policy_version", "--format", "json").stdout)
    assert prompts and all(0 <= p["pooled_accuracy"] <= 1 for p in prompts if p["pooled_accuracy"] is not None)


def test_curation_spills_beyond_memory_limit(tmp_path):
    """~8 M tokens (~128 MB of raw token arrays) curated under a 32 MB DuckDB limit, same result
    as with a roomy limit."""
    root = str(tmp_path / "big")
    with Buffer.init(root) as buf:
        for step in range(64):
            buf.append_rollouts(rollouts_table(n_groups=60, group_size=8, mean_tokens=256, step=step,
                                               policy_version=step // 8, seed=4, n_prompts=400))
        tokens = sum(s.tokens for s in buf.snapshot().shards("rollouts"))
        assert tokens > 7_500_000
        sets = {"where": "true", "progress": "0.5", "amplify": "da3po"}
        tight = curate(buf, load_recipe("d3s"), sets, limits=Limits("32MB"), commit=False)
        roomy = curate(buf, load_recipe("d3s"), sets, limits=Limits("2GB"), commit=False)
    assert tight.record["n_selected"] > 0
    assert tight.audit.equals(roomy.audit)
    assert tight.curated.equals(roomy.curated)


def test_materialisation_groups_of_shards_keep_the_shard_order(tmp_path, monkeypatch):
    """The embedded engine reads several input shards per materialisation query, within a byte cap
    (groups of `threads` shards here, MATERIALISE_GROUP_SHARDS). Shards appended newest step first
    make the manifest order differ from rollout_id order: the curated rows must still come input
    shard by input shard, then by rollout_id, the same rows as when each shard is read alone
    (threads=1); the audit byte for byte, curated shards up to the shard names each buffer draws
    (their references compare by shard order)."""
    import hashlib

    import rollstore.curate.layout as output_module
    import rollstore.curate.run as run_module

    monkeypatch.setattr(output_module, "CURATED_SHARD_BYTES", 10_000)
    digests = {}
    for key, threads in (("1", 1), ("2", 2), ("3", 3), ("3 capped", 3)):
        root = str(tmp_path / key.replace(" ", "-"))
        with Buffer.init(root) as buf:
            for step in (4, 3, 2, 1, 0):
                buf.append_rollouts(rollouts_table(n_groups=6, group_size=4, mean_tokens=24, seed=5, step=step))
            files = buf.snapshot().files("rollouts")
            monkeypatch.setattr(run_module, "MATERIALISE_GROUP_SHARDS", threads)
            if key == "3 capped":  # room for two shards per query: groups of 3 become 2, 2, 1
                monkeypatch.setattr(run_module, "MATERIALISE_GROUP_BYTES", 2 * max(map(os.path.getsize, files)))
            assert [len(g) for g in run_module._shard_groups(files, threads)] == (
                [2, 2, 1] if key in ("2", "3 capped") else [3, 2] if key == "3" else [1] * 5)
            r = curate(buf, load_recipe("d3s"), {"where": "true"}, limits=Limits(threads=threads))
        curated = [p for p in r.output_files if p.startswith("curated/")]
        assert len(curated) >= 2
        # each buffer names its shards anew: the references compare by the shard's manifest order
        order = {os.path.relpath(f, root): i for i, f in enumerate(files)}
        digests[key] = [hashlib.sha256(open(os.path.join(root, p), "rb").read()).hexdigest()
                        for p in r.output_files if not p.startswith("curated/")]
        for p in curated:
            t = pq.read_table(os.path.join(root, p))
            shard = pa.array([order[x] for x in t.column("rollouts_shard").to_pylist()])
            digests[key].append(t.set_column(t.schema.get_field_index("rollouts_shard"), "rollouts_shard", shard)
                                .to_pylist())
        table = pq.read_table(os.path.join(root, curated[0]))
        steps = [int(rid.split("-s")[1].split("-")[0]) for rid in table.column("rollout_id").to_pylist()]
        assert steps == sorted(steps, reverse=True), "rows follow the shards' (manifest) order"
    assert digests["1"] == digests["2"] == digests["3"] == digests["3 capped"]


def test_ahead_keeps_order_and_hands_errors_and_early_stops_back():
    """`ahead` (the next curated part is built while the current one is written): same items in
    the same order; the producer's error is raised in the caller after the items before it; a
    caller that stops early stops the producer and closes its generator."""
    import threading

    from rollstore.curate.threads import ahead

    assert list(ahead(iter(range(7)))) == list(range(7))
    assert list(ahead(iter([]))) == []

    def failing():
        yield 1
        yield 2
        raise OSError("no space left (test)")

    got = []
    with pytest.raises(OSError, match="no space left"):
        for x in ahead(failing()):
            got.append(x)
    assert got == [1, 2]

    closed = threading.Event()
    produced = []

    def endless():
        try:
            i = 0
            while True:
                produced.append(i)
                yield i
                i += 1
        finally:
            closed.set()

    with pytest.raises(RuntimeError, match="writer failed"):
        for x in ahead(endless()):
            if x == 3:
                raise RuntimeError("writer failed (test)")
    assert closed.is_set(), "the producer's generator is closed"
    assert len(produced) <= 6, "the producer stops: at most one item beyond the one in hand"
    assert not [t for t in threading.enumerate() if t.name == "rollstore-materialise"]
