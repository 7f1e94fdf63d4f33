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
