"""`rollstore init` and `rollstore info` over the storage layer."""

from __future__ import annotations

import json
import os

from conftest import write_parquet
from rollstore.builtin.synthetic import rollouts_table


def test_init_is_idempotent_and_info_reports(cli, tmp_path):
    root = str(tmp_path / "buf")
    res = cli("init", root)
    assert res.code == 0 and os.path.exists(os.path.join(root, "manifest.sqlite"))
    for sub in ("rollouts", "curated", "audit", "tmp"):
        assert os.path.isdir(os.path.join(root, sub))
    t = rollouts_table(n_groups=3, group_size=4, mean_tokens=20, policy_version=2)
    assert cli("import", root, write_parquet(t, tmp_path / "t.parquet")).code == 0
    assert cli("init", root).code == 0  # again: keeps what is there
    res = cli("info", root, "--format", "json")
    assert res.code == 0, res.stderr
    info = json.loads(res.stdout)
    r = info["tables"]["rollouts"]
    tokens = sum(len(v) for v in t.column("response_token_ids").to_pylist())
    assert (r["shards"], r["rows"], r["tokens"]) == (1, 12, tokens)
    assert info["groups"] == 3 and info["policy_versions"] == [2]
    assert info["bytes_per_token"] == r["bytes"] / tokens
    assert info["tables"]["curated"] == {"shards": 0, "rows": 0, "tokens": 0, "bytes": 0}
    res = cli("info", root)
    assert res.code == 0 and "rollouts" in res.stdout


def test_info_reads_the_rollouts_shards_only(cli, tmp_path):
    """`info` counts every table from the catalog and reads only the rollouts shards (a long run's
    thousands of audit, record and checkpoint shards are not opened): a curated or audit shard gone
    does not change what it prints, a rollouts shard gone is one line naming it."""
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.storage.buffer import Buffer

    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        for step in range(2):
            buf.append_rollouts(rollouts_table(n_groups=4, group_size=4, step=step, policy_version=step, seed=step))
        curate(buf, load_recipe("d3s"), {})
        with buf.snapshot() as snap:
            others = [s.path for t in ("curated", "selections", "curations") for s in snap.shards(t)]
            rollouts = [s.path for s in snap.shards("rollouts")]
    before = json.loads(cli("info", root, "-f", "json").stdout)
    assert before["groups"] == 8 and before["policy_versions"] == [0, 1] and before["tables"]["selections"]["rows"] > 0
    for path in others:
        os.remove(os.path.join(root, path))
    assert json.loads(cli("info", root, "-f", "json").stdout) == before
    os.remove(os.path.join(root, rollouts[0]))
    res = cli("info", root)
    assert res.code == 1 and rollouts[0] in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_import_reports_each_file(cli, buffer_dir, tmp_path):
    a = write_parquet(rollouts_table(n_groups=1, group_size=4, step=0), tmp_path / "a.parquet")
    b = write_parquet(rollouts_table(n_groups=2, group_size=4, step=1), tmp_path / "b.parquet")
    res = cli("import", buffer_dir, a, b)
    assert res.code == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{a}: 4 rows") and lines[1].startswith(f"{b}: 8 rows")


def test_missing_file_is_one_error_line(cli, buffer_dir, tmp_path):
    for name in ("nope.jsonl", "nope.parquet"):
        res = cli("import", buffer_dir, str(tmp_path / name))
        assert res.code != 0 and name in res.stderr and len(res.stderr.strip().splitlines()) == 1
