"""Curation on dask.distributed against the embedded engine: byte-identical curated shards and audit,
the same curation id and record, for every built-in recipe, on generated data spread over several
input shards and hash partitions; a worker killed mid-run; failures that leave nothing visible.

One LocalCluster (2 worker processes, 1 thread each) serves the module. Every comparison curates
two copies of one generated buffer, one per engine. CURATED_SHARD_BYTES is made small so that the
curated rows span several output shards, cut across input shards.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import signal
import threading
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest

distributed = pytest.importorskip("distributed")

import rollstore.curate.layout as output_module  # noqa: E402
from rollstore.curate.dask_client import curate_dask  # noqa: E402
from rollstore.curate.options import Dask, engine_option  # noqa: E402
from rollstore.curate.params import ParamError, load_recipe  # noqa: E402
from rollstore.curate.run import CurationError, curate  # noqa: E402
from rollstore.builtin.synthetic import RowOptions, rollouts_table  # noqa: E402
from rollstore.storage.buffer import Buffer  # noqa: E402

RECIPES = ["grpo", "dapo", "da3po", "pods", "d1s", "d1s-c", "d2s", "d3s", "d3s-i", "entropy-top"]
ALL = {"where": "true", "progress": "0.4"}


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster, distributed.Client(cluster) as c:
        yield c


@pytest.fixture(autouse=True)
def small_curated_shards(monkeypatch):
    monkeypatch.setattr(output_module, "CURATED_SHARD_BYTES", 10_000)


def _generate(root: str) -> None:
    """5 input shards, 4 policy versions, 9 prompts shared across steps (history for da3po),
    group sizes 1–8, shaped rewards in one step, a shard without entropies or old log-probs."""
    with Buffer.init(root) as buf:
        for step, (groups, size) in enumerate([(9, 6), (7, 8), (11, 4), (6, 1), (8, 5)]):
            table = rollouts_table(n_groups=groups, group_size=size, mean_tokens=24, seed=11, step=step,
                                   policy_version=min(step, 3), n_prompts=9,
                                   options=RowOptions(with_old_logprobs=step != 2))
            if step == 2:
                shaped = pc.add(table.column("reward"), pa.array(
                    [(-0.25, 0.1, 0.0, -0.5)[i % 4] for i in range(table.num_rows)], pa.float32()))
                table = table.set_column(table.schema.get_field_index("reward"), "reward", shaped)
            buf.append_rollouts(table)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dask") / "buf")
    _generate(root)
    return root


@pytest.fixture
def pair(template, tmp_path):
    """Two identical copies of the generated buffer: (embedded's, dask's)."""
    a, b = str(tmp_path / "embedded"), str(tmp_path / "dask")
    shutil.copytree(template, a)
    shutil.copytree(template, b)
    return a, b


def _files(root: str, paths: list[str]) -> dict[str, str]:
    return {p: hashlib.sha256(open(os.path.join(root, p), "rb").read()).hexdigest() for p in paths}


def _manifest_rows(buf: Buffer, curation_id: str) -> list[tuple]:
    return buf.manifest.con.execute(
        "SELECT table_name, path, rows, tokens, bytes, sha256, key FROM shards WHERE key = ? "
        "AND table_name IN ('curated', 'selections') ORDER BY path", (curation_id,)).fetchall()


def _both(pair, client, recipe: str, sets: dict, partitions: int = 5, **kw):
    a, b = pair
    with Buffer.open(a) as buf:
        ra = curate(buf, load_recipe(recipe), dict(sets))
        rows_a = _manifest_rows(buf, ra.curation_id)
    with Buffer.open(b) as buf:
        rb = curate(buf, load_recipe(recipe), dict(sets), engine=Dask(client, partitions), **kw)
        rows_b = _manifest_rows(buf, rb.curation_id)
    return ra, rb, rows_a, rows_b


def assert_identical(pair, ra, rb, rows_a, rows_b) -> None:
    a, b = pair
    assert rb.curation_id == ra.curation_id
    assert rb.output_files == ra.output_files
    assert _files(b, rb.output_files) == _files(a, ra.output_files), "curated shards and audit byte-identical"
    assert rows_b == rows_a, "manifest rows (rows, tokens, bytes, sha256) identical"
    assert rb.audit.equals(ra.audit)
    assert rb.reasons == ra.reasons
    for key, value in ra.record.items():
        if key != "created_at":
            assert rb.record[key] == value, key
    assert not glob.glob(os.path.join(b, "tmp", "curate-*")), "the run folder is removed"


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_is_byte_identical(pair, client, recipe):
    ra, rb, rows_a, rows_b = _both(pair, client, recipe, ALL)
    assert ra.record["n_candidates"] == 200 and ra.record["n_selected"] > 0
    assert sum(1 for p in ra.output_files if p.startswith("curated/")) >= 2, "several curated shards"
    assert_identical(pair, ra, rb, rows_a, rows_b)


@pytest.mark.parametrize("recipe", ["replay-groups", "replay-d3s", "replay-rollouts", "replay-window"])
def test_replay_recipes_are_byte_identical(pair, client, recipe):
    """The fresh batch is the last step; the window (steps 1-2, versions 1-2) is read per shard and
    the replay choice merged on the client: same rows, same bytes."""
    ra, rb, rows_a, rows_b = _both(pair, client, recipe, {"where": "step = 4", "progress": "0.4"}, partitions=3)
    replayed = [r for r in ra.audit.to_pylist() if r["replayed"]]
    assert replayed and {r["age"] for r in replayed} <= {1, 2}
    assert_identical(pair, ra, rb, rows_a, rows_b)


@pytest.mark.parametrize("sets, partitions", [
    ({"amplify": "da3po", "filter": "dynamic", "sample": "cross_group", "token": "abs_adv_entropy",
      "schedule": "linear", "progress": "0.3", "difficulty_window": "2"}, 3),
    ({"sample": "pods", "amplify": "da3po", "std": "population", "truncated": "drop", "max_policy_lag": "1"}, 3),
    ({"sample": "in_group", "sample_fraction": "0.07", "token": "entropy", "token_fraction": "0.33"}, 3),
    # groups of one only: dynamic sampling empties the pool; more partitions than prompts
    ({"where": "step = 3", "filter": "dynamic", "sample": "cross_group", "token": "abs_adv_entropy"}, 12),
])
def test_combinations_are_byte_identical(pair, client, sets, partitions):
    ra, rb, rows_a, rows_b = _both(pair, client, "grpo", {"where": "step >= 1", **sets}, partitions=partitions)
    if sets.get("where") == "step = 3":
        assert ra.record["n_selected"] == 0 and ra.record["adv_var_before"] is None
    assert_identical(pair, ra, rb, rows_a, rows_b)


def test_default_batch_reuse_and_one_partition(pair, client):
    """The default `where` (latest step) and current_version, merged over shards; `max_reuse`
    reads the audit of an earlier curation; one partition holds everything."""
    a, b = pair
    for root in pair:
        with Buffer.open(root) as buf:
            curate(buf, load_recipe("d1s"), {"where": "step >= 3"})
    ra, rb, rows_a, rows_b = _both(pair, client, "d3s", {"max_reuse": "1", "progress": "0"}, partitions=1)
    assert "reused" in ra.reasons
    assert_identical(pair, ra, rb, rows_a, rows_b)


def test_engines_are_idempotent_with_each_other(pair, client):
    a, b = pair
    ra, rb, _, _ = _both(pair, client, "d2s", ALL)
    with Buffer.open(b) as buf:
        seq = buf.manifest.latest_seq()
        again = curate(buf, load_recipe("d2s"), ALL, snapshot_seq=rb.snapshot_seq)  # embedded over dask's commit
        assert again.curation_id == rb.curation_id and again.already_existed
        assert buf.manifest.latest_seq() == seq
    with Buffer.open(a) as buf:
        again = curate(buf, load_recipe("d2s"), ALL, snapshot_seq=ra.snapshot_seq, engine=Dask(client))
        assert again.curation_id == ra.curation_id and again.already_existed
        assert again.audit.equals(ra.audit) and again.record["n_selected"] == ra.record["n_selected"]


def test_dry_run_commits_nothing(pair, client):
    a, b = pair
    with Buffer.open(a) as buf:
        ra = curate(buf, load_recipe("d3s"), ALL, commit=False)
    with Buffer.open(b) as buf:
        seq = buf.manifest.latest_seq()
        rb = curate(buf, load_recipe("d3s"), ALL, commit=False, engine=Dask(client))
        assert buf.manifest.latest_seq() == seq and not rb.committed
    assert rb.curation_id == ra.curation_id
    assert rb.curated.equals(ra.curated) and rb.audit.equals(ra.audit)
    assert not os.listdir(os.path.join(b, "curated")) and not os.listdir(os.path.join(b, "audit"))
    assert not glob.glob(os.path.join(b, "tmp", "curate-*"))


def _nothing_visible(root: str, seq: int) -> None:
    with Buffer.open(root) as buf:
        assert buf.manifest.latest_seq() == seq, "no commit"
    assert not [f for d in ("curated", "audit") for f in glob.glob(os.path.join(root, d, "**", "*"), recursive=True)]
    assert not glob.glob(os.path.join(root, "tmp", "curate-*", "*"))


def test_errors_match_and_leave_nothing(pair, client, tmp_path):
    a, b = pair
    with Buffer.open(b) as buf:
        seq = buf.manifest.latest_seq()
        with pytest.raises(CurationError, match="empty batch: no rollouts match where = false"):
            curate(buf, load_recipe("grpo"), {"where": "false"}, engine=Dask(client))
        # step 2 has no old_logprobs, but every shard has entropies: make one without
    no_entropy = str(tmp_path / "noent")
    with Buffer.init(no_entropy) as buf:
        buf.append_rollouts(rollouts_table(n_groups=4, group_size=4, seed=2, step=0))
        buf.append_rollouts(rollouts_table(n_groups=4, group_size=4, seed=2, step=1, options=RowOptions(with_entropies=False)))
        messages = []
        for engine in ("embedded", "dask"):
            with pytest.raises(CurationError) as info:
                curate(buf, load_recipe("d2s"), ALL, **({"engine": Dask(client)} if engine == "dask" else {}))
            messages.append(str(info.value))
        assert messages[0] == messages[1] and "entropies" in messages[0]
    with Buffer.open(b) as buf:
        with pytest.raises(ParamError, match="embedded engine only"):
            curate(buf, load_recipe(str(_custom(tmp_path))), {}, engine=Dask(client))
        with pytest.raises(ParamError, match="local:N"):
            curate(buf, load_recipe("grpo"), ALL, engine=Dask("local:0"))
        with pytest.raises(ParamError, match="--engine dask"):
            engine_option("embedded", "local:2")
    _nothing_visible(b, seq)


def test_an_inexact_token_threshold_is_refused_and_leaves_nothing(pair, client, monkeypatch):
    """Both engines prove the threshold before writing: a threshold that is not the K-th token
    (here: one after every token, as a non-monotone bucket key would give) keeps a number of tokens
    other than K, and the run stops with the same one-line error and nothing visible."""
    import rollstore.curate.merges as merges_module

    def wrong(heads, offset):
        return float("inf"), "", 0

    monkeypatch.setattr(merges_module, "threshold_of", wrong)  # the `heads` merge both engines use
    b = pair[1]
    with Buffer.open(b) as buf:
        seq = buf.manifest.latest_seq()
        messages = []
        for kw in ({}, {"engine": Dask(client)}):
            with pytest.raises(CurationError, match=r"token threshold is not exact: the mask keeps 0 tokens") as info:
                curate(buf, load_recipe("d3s"), ALL, **kw)
            messages.append(str(info.value))
        assert messages[0] == messages[1] and "\n" not in messages[0]
    _nothing_visible(b, seq)


def _custom(tmp_path) -> str:
    path = tmp_path / "mine.sql"
    path.write_text("SELECT rollout_id, advantage FROM candidates")
    return str(path)


def test_missing_dask_is_one_clear_line(pair, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "distributed", None)
    with Buffer.open(pair[1]) as buf:
        with pytest.raises(CurationError, match=r"needs dask.distributed: pip install 'rollstore\[dask\]'"):
            curate(buf, load_recipe("grpo"), ALL, engine=Dask("local:1"))


def test_a_failing_task_after_files_were_written_leaves_nothing(pair, client):
    """The audit task fails after every curated shard was written to tmp: nothing is committed,
    no file is visible, and the run folder is gone."""
    b = pair[1]
    with Buffer.open(b) as buf:
        seq = buf.manifest.latest_seq()
        with pytest.raises(RuntimeError, match="test hook: audit task failed"):
            curate_dask(buf, load_recipe("grpo"), ALL, dask=Dask(client), _task_hooks={"audit": "fail"})
    _nothing_visible(b, seq)


def test_cli_engine_dask_local_cluster(pair):
    """`rollstore curate --engine dask --scheduler local:2` prints the embedded engine's id."""
    import subprocess
    import sys

    bin_ = os.path.join(os.path.dirname(sys.executable), "rollstore")
    a, b = pair
    ids = []
    for root, extra in ((a, []), (b, ["--engine", "dask", "--scheduler", "local:2", "--partitions", "3"])):
        res = subprocess.run([bin_, "curate", root, "--recipe", "da3po", "--set", "where=true", *extra],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        ids.append(res.stdout.strip().splitlines()[-1])
    assert ids[0] == ids[1] and ids[0].startswith("cur-")


def _kill_one_worker_while(client, predicate, timeout=60.0) -> int:
    """Wait until a task matching `predicate` is processing on a worker, then SIGKILL that worker."""
    pids = client.run(os.getpid)
    deadline = time.time() + timeout
    while time.time() < deadline:
        for address, keys in client.processing().items():
            if any(predicate(str(k)) for k in keys) and address in pids:
                os.kill(pids[address], signal.SIGKILL)
                return pids[address]
        time.sleep(0.05)
    raise AssertionError("no matching task started")


def test_killed_worker_fails_cleanly_or_completes_identically(pair, client):
    """A worker is SIGKILLed while partition tasks run: the run either raises and leaves nothing
    visible, or completes with the embedded engine's bytes (Dask reruns the lost tasks)."""
    a, b = pair
    with Buffer.open(a) as buf:
        ra = curate(buf, load_recipe("d3s"), ALL)
        rows_a = _manifest_rows(buf, ra.curation_id)
    outcome: dict = {}

    def go():
        try:
            with Buffer.open(b) as buf:
                outcome["result"] = curate_dask(buf, load_recipe("d3s"), ALL, dask=Dask(client, 6),
                                                _task_hooks={"groups": 0.6, "materialise": 0.3})
                outcome["rows"] = _manifest_rows(buf, outcome["result"].curation_id)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    with Buffer.open(b) as buf:
        seq = buf.manifest.latest_seq()
    worker = threading.Thread(target=go)
    worker.start()
    _kill_one_worker_while(client, lambda key: "partition_start" in key)
    worker.join(300)
    assert not worker.is_alive()
    print("outcome after the kill:", repr(outcome.get("error", "completed")))
    if "error" in outcome:
        _nothing_visible(b, seq)
    else:
        assert_identical(pair, ra, outcome["result"], rows_a, outcome["rows"])
    client.wait_for_workers(2, timeout=120)  # the nanny restarts the killed worker


def test_killed_worker_with_no_retries_fails_cleanly(pair):
    """With Dask's allowed-failures at 0, losing a worker mid-run fails the run: nothing visible."""
    import dask

    b = pair[1]
    with Buffer.open(b) as buf:
        seq = buf.manifest.latest_seq()
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
            distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                     dashboard_address=":0") as cluster, distributed.Client(cluster) as c:
        outcome: dict = {}

        def go():
            try:
                with Buffer.open(b) as buf:
                    curate_dask(buf, load_recipe("grpo"), ALL, dask=Dask(c, 4),
                                _task_hooks={"materialise": 1.0})
            except BaseException as exc:  # noqa: BLE001
                outcome["error"] = exc

        worker = threading.Thread(target=go)
        worker.start()
        _kill_one_worker_while(c, lambda key: "materialise_part" in key)
        worker.join(300)
    assert isinstance(outcome.get("error"), distributed.KilledWorker), outcome
    _nothing_visible(b, seq)


def test_written_parts_publish_in_one_commit_or_not_at_all(tmp_path):
    """Storage side: files a worker wrote under tmp/ are linked into place by `Buffer.commit`, in
    its one transaction; a failing commit unlinks them; bad paths and sizes are refused."""
    from rollstore.storage.buffer import TABLE_DIRS, WrittenPart, token_count
    from rollstore.storage.schema import ROLLOUTS
    from rollstore.storage.shardio import write_tmp

    root = str(tmp_path / "buf")
    table = rollouts_table(n_groups=2, group_size=2).cast(ROLLOUTS)
    with Buffer.init(root) as buf:
        with pytest.raises(FileNotFoundError):
            write_tmp(table, root, "tmp/run-gone")  # the folder belongs to its owner: never created here
        os.makedirs(os.path.join(root, "tmp", "run"))

        def written(name: str, table_name: str = "curated") -> WrittenPart:
            rel, nbytes, sha = write_tmp(table, root, "tmp/run")
            return WrittenPart(table_name, rel, f"{TABLE_DIRS[table_name]}/{name}.parquet", table.num_rows,
                               token_count(table), nbytes, sha)

        def refuse(*_):
            raise RuntimeError("refused in the transaction")

        seq = buf.manifest.latest_seq()
        part = written("a")
        with pytest.raises(RuntimeError):
            buf.commit([part], "test", on_commit=refuse)
        assert buf.manifest.latest_seq() == seq and not os.path.exists(os.path.join(root, "curated", "a.parquet"))
        for bad, error in [(WrittenPart("curated", part.tmp_relpath, "rollouts/../curated/b.parquet", 4, 0, part.bytes, ""), ValueError),
                           (WrittenPart("selections", part.tmp_relpath, "curated/b.parquet", 4, 0, part.bytes, ""), ValueError),
                           (WrittenPart("curated", "curated/x.parquet", "curated/b.parquet", 4, 0, part.bytes, ""), ValueError),
                           (written("r", "rollouts"), ValueError),  # rollouts are committed from rows (checked finite)
                           (WrittenPart("curated", written("c").tmp_relpath, "curated/c.parquet", 4, 0, 1, ""), OSError)]:
            with pytest.raises(error):
                buf.commit([bad], "test")
        assert buf.manifest.latest_seq() == seq
        good = written("d")
        buf.commit([good], "test")
        assert buf.snapshot().files("curated") == [os.path.join(root, "curated", "d.parquet")]
        assert not os.path.exists(os.path.join(root, good.tmp_relpath))
