"""`rollstore export` (issue 16 item 3): a snapshot as plain Parquet plus a dataset card, read back
with DuckDB, Polars, pandas and Hugging Face `datasets` without rollstore; the values must equal
what rollstore returns for that snapshot."""

from __future__ import annotations

import datetime as dt
import importlib.util
import os

import duckdb
import numpy as np
import pandas as pd
import polars as pl
import pytest

from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer


@pytest.fixture
def filled(tmp_path):
    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        for v in range(2):
            buf.append_rollouts(rollouts_table(n_groups=3, group_size=4, mean_tokens=6, step=v, policy_version=v, seed=5))
    return root


def rollstore_rows(root: str, seq: int | None = None) -> list[dict]:
    with Buffer.open(root) as buf, buf.snapshot(seq) as snap:
        rows = snap.arrow("rollouts").to_table().to_pylist()
    return sorted(rows, key=lambda r: r["rollout_id"])


def plain(value):
    """A value as plain Python, whichever reader produced it (numpy arrays, pandas timestamps, NaN)."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, pd.Timestamp):
        return value.to_pydatetime()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and value != value:
        return None
    if value is pd.NA or value is pd.NaT:
        return None
    return value


def same(rows: list[dict], expect: list[dict]) -> None:
    assert len(rows) == len(expect)
    for got, want in zip(rows, expect):
        assert set(got) == set(want)
        for k, v in want.items():
            g = plain(got[k])
            if isinstance(v, dt.datetime):
                g = g.replace(tzinfo=dt.timezone.utc) if g.tzinfo is None else g
            assert g == v, (k, got["rollout_id"])


def test_export_opens_in_duckdb_polars_pandas_datasets(filled, tmp_path, cli):
    out = tmp_path / "export"
    res = cli("export", filled, "--to", str(out))
    assert res.code == 0, res.stderr
    assert sorted(os.listdir(out)) == ["README.md", "rollouts"]
    expect = rollstore_rows(filled)
    files = str(out / "rollouts" / "*.parquet")

    same(duckdb.sql(f"SELECT * FROM read_parquet('{files}') ORDER BY rollout_id").to_arrow_table().to_pylist(), expect)
    same(pl.read_parquet(files).sort("rollout_id").to_dicts(), expect)
    df = pd.read_parquet(out / "rollouts").sort_values("rollout_id")
    same(df.to_dict("records"), expect)

    card = (out / "README.md").read_text()
    assert card.startswith("---\nconfigs:\n- config_name: rollouts\n")
    assert "path: rollouts/*.parquet" in card and "| rollouts | 24 |" in card

    if importlib.util.find_spec("datasets") is None:
        pytest.skip("Hugging Face datasets is not installed; DuckDB, Polars and pandas matched")
    from datasets import load_dataset

    ds = load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))
    same(sorted(ds.to_list(), key=lambda r: r["rollout_id"]), expect)
    ds2 = load_dataset(str(out), "rollouts", split="train", cache_dir=str(tmp_path / "hf2"))
    assert ds2.num_rows == len(expect)


def test_export_of_an_older_snapshot(filled, tmp_path, cli):
    with Buffer.open(filled) as buf:
        first = buf.manifest.shards("rollouts")[0].added_seq
    out = tmp_path / "old"
    assert cli("export", filled, "--snapshot", str(first), "--to", str(out)).code == 0
    got = duckdb.sql(f"SELECT * FROM read_parquet('{out}/rollouts/*.parquet') ORDER BY rollout_id").to_arrow_table().to_pylist()
    same(got, rollstore_rows(filled, first))
    assert len(got) == 12


def test_export_refuses_managed_files_and_non_empty_dirs(filled, tmp_path, cli):
    for bad in ("rollouts/x", "tmp", "meta/out", "manifest.sqlite"):
        res = cli("export", filled, "--to", os.path.join(filled, bad))
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        assert res.code != 0 and len(lines) == 1 and "managed files" in lines[0], (bad, res.stderr)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    res = cli("export", filled, "--to", str(tmp_path / "full"))
    assert res.code != 0 and "not an empty directory" in res.stderr
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]
