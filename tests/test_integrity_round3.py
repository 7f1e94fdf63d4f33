"""Integrity, round three (issue 35): training verifies what thin curated shards refer to, use caps
hold under concurrent curations, no non-finite number is trained or published, every curation
parameter has a range rule; and (issue 36, item 4) no file is unlinked while a commit's outcome is
unknown.

Commands go through the real command line (typer's CliRunner in-process) unless said otherwise."""

from __future__ import annotations

import os
import shutil
import sqlite3

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rollstore.storage.buffer import Buffer, Part
from rollstore.builtin.synthetic import rollouts_table


from test_integrity_round2 import one_error_line, seq_of  # noqa: E402  (shared helpers)


def tiny_rows(seed: int, step: int = 0, n_groups: int = 4, group_size: int = 4) -> pa.Table:
    """Synthetic rollouts whose token ids the builtin tiny model (24 ids) can embed."""
    table = rollouts_table(n_groups=n_groups, group_size=group_size, step=step, policy_version=step, seed=seed)
    for name in ("prompt_token_ids", "response_token_ids"):
        col = table.column(name).combine_chunks()
        values = pa.array(col.values.to_numpy() % 20 + 1, pa.int32())
        fixed = pa.ListArray.from_arrays(col.offsets, values)
        table = table.set_column(table.column_names.index(name), name, fixed.cast(table.schema.field(name).type))
    return table


# ---- issue 36, item 4: no file is unlinked while a commit's outcome is unknown -------------------
@pytest.mark.parametrize("took_effect", [True, False])
def test_a_failed_commit_statement_unlinks_nothing(buffer_dir, monkeypatch, took_effect):
    """COMMIT sent, then an error (a lost acknowledgement): whether or not it took effect, and even
    when the manifest then *seems* not to name the file (a stale view), no file is removed."""
    import contextlib

    buf = Buffer.open(buffer_dir)
    real = buf.manifest.transaction

    @contextlib.contextmanager
    def lost_ack():
        with contextlib.ExitStack() as stack:
            if took_effect:
                con = stack.enter_context(real())
                yield con
            else:  # the server rolled back after COMMIT was sent
                buf.manifest.con.execute("BEGIN IMMEDIATE")
                yield buf.manifest.con
                buf.manifest.con.execute("ROLLBACK")
        raise sqlite3.OperationalError("disk I/O error (COMMIT acknowledgement lost)")

    monkeypatch.setattr(buf.manifest, "transaction", lost_ack)
    monkeypatch.setattr(buf.manifest, "is_unnamed", lambda path: True)  # what a stale view would say
    with pytest.raises(sqlite3.OperationalError):
        buf.commit([Part("rollouts", tiny_rows(1))], "append")
    files = [f for f in os.listdir(os.path.join(buffer_dir, "rollouts")) if f.endswith(".parquet")]
    assert len(files) == 1, files  # the file stays: an orphan for gc when the commit did not take effect
    monkeypatch.undo()
    named = {s.path for s in buf.manifest.shards("rollouts")}
    assert (f"rollouts/{files[0]}" in named) == took_effect
    buf.close()


def test_a_failure_before_commit_still_removes_the_files(buffer_dir):
    buf = Buffer.open(buffer_dir)

    def boom(con, seq, ids):
        raise RuntimeError("inside the transaction")

    with pytest.raises(RuntimeError):
        buf.commit([Part("rollouts", tiny_rows(1))], "append", on_commit=boom)
    assert [f for f in os.listdir(os.path.join(buffer_dir, "rollouts")) if f.endswith(".parquet")] == []
    buf.close()


# ---- 1 and 5: training verifies the rollouts shards thin curated shards refer to ----------------
def same_size_tamper(path: str) -> None:
    """Rewrite the Parquet file `path` with wrong data at exactly its size, as a valid file: token ids
    shifted, `old_logprobs` set to -50, rewards negated (the red team's tamper). The new file is
    padded between its last column chunk and its footer (offsets are absolute: nothing moves)."""
    table = pq.read_table(path)
    size = os.path.getsize(path)
    ids = table.column("response_token_ids").combine_chunks()
    shifted = pa.ListArray.from_arrays(ids.offsets, pa.array(ids.values.to_numpy() % 20 + 2, pa.int32()))
    old = table.column("gen_logprobs").combine_chunks()
    minus50 = pa.ListArray.from_arrays(old.offsets, pa.array([-50.0] * len(old.values), pa.float32()))
    for name, values in (("response_token_ids", shifted), ("old_logprobs", minus50),
                         ("reward", pc.negate(table.column("reward")))):
        field = table.schema.field(name)
        table = table.set_column(table.column_names.index(name), field, values.cast(field.type))
    tmp = path + ".tamper"
    pq.write_table(table, tmp, compression="zstd", compression_level=19)
    data = open(tmp, "rb").read()
    os.unlink(tmp)
    assert len(data) <= size, (len(data), size)
    footer_len = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - footer_len
    padded = data[:start] + b"\0" * (size - len(data)) + data[start:]
    mtime = os.stat(path).st_mtime_ns
    with open(path, "r+b") as fh:  # in place: same inode
        fh.write(padded)
    os.utime(path, ns=(mtime, mtime))  # even the modification time is kept
    assert os.path.getsize(path) == size
    assert pq.read_table(path).column("old_logprobs")[0].as_py()[0] == -50.0


def flip_byte(path: str, at: int | None = None) -> None:
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 3 if at is None else at)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def thin(tmp_path, cli):
    """A buffer with two steps of tiny-model rows and one thin `grpo` curation of both."""
    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        for step in range(2):
            buf.append_rollouts(tiny_rows(3 + step, step=step))
    res = cli("curate", root, "--recipe", "grpo", "--set", "where=true")
    assert res.code == 0, res.stderr
    return root


def referenced(root: str) -> str:
    """The full path of the first rollouts shard the curation refers to."""
    from rollstore.storage.references import referenced_shards

    with Buffer.open(root) as buf:
        curated = [os.path.join(root, s.path) for s in buf.manifest.shards("curated")]
    return os.path.join(root, sorted(referenced_shards(curated))[0])


TAMPERS = ["same-size", "truncated", "flipped-byte", "link-outside"]


def tamper(path: str, how: str, tmp_path) -> str:
    """Damage `path` as `how` says; return the words the refusal must hold."""
    if how == "same-size":
        same_size_tamper(path)
        return "sha256 differs"
    if how == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
        return "size differs"
    if how == "flipped-byte":
        flip_byte(path)
        return "sha256 differs"
    copy = str(tmp_path / "copy.parquet")  # identical bytes elsewhere, the shard a link to them
    shutil.copyfile(path, copy)
    os.unlink(path)
    os.symlink(copy, path)
    return "symbolic link"


@pytest.mark.parametrize("follow", [False, True])
@pytest.mark.parametrize("how", TAMPERS)
def test_train_refuses_a_damaged_referenced_rollouts_shard(cli, thin, tmp_path, how, follow):
    path = referenced(thin)
    words = tamper(path, how, tmp_path)
    seq = seq_of(thin)
    extra = ["--follow", "--max-idle", "1", "--poll", "0.1"] if follow else []
    line = one_error_line(cli("train", thin, "--model", "builtin:tiny", *extra))
    assert path in line and words in line, line
    assert seq_of(thin) == seq  # nothing published
    assert not os.listdir(os.path.join(thin, "checkpoints"))


def test_train_refuses_a_referenced_shard_that_is_not_live(cli, thin):
    """A referenced rollouts shard retired behind the curation's back (its row marked removed, the
    file left where it was): the reference does not resolve, whatever the file holds."""
    path = referenced(thin)
    rel = os.path.relpath(path, thin)
    with Buffer.open(thin) as buf, buf.manifest.transaction() as con:
        con.execute("UPDATE shards SET removed_seq = added_seq WHERE path = ?", (rel,))
    line = one_error_line(cli("train", thin, "--model", "builtin:tiny"))
    assert rel in line and "not live" in line, line


def test_training_hashes_each_referenced_shard_once_per_process(thin, monkeypatch):
    from rollstore.storage import shardio, verify

    hashed = []
    real = shardio.sha256_file
    monkeypatch.setattr(verify, "sha256_file", lambda p: hashed.append(p) or real(p))
    monkeypatch.setattr(verify, "_verified", set())
    with Buffer.open(thin) as buf:
        shards = buf.manifest.shards("curated")
        for _ in range(3):
            verify.verify_training_inputs(buf.root, buf.manifest, shards)
        n_rollouts = len(buf.manifest.shards("rollouts"))
    assert len(hashed) == len(shards) + n_rollouts and len(set(hashed)) == len(hashed)


def test_the_learner_reader_names_an_undecodable_shard(thin):
    """Read without verification first (a caller of `learner.batches.read_curated`): a truncated
    rollouts shard is the one line naming the file, not Arrow's anonymous message."""
    from rollstore.learner.batches import read_curated
    from rollstore.storage.errors import RollstoreError

    path = referenced(thin)
    with Buffer.open(thin) as buf:
        curated = [os.path.join(thin, s.path) for s in buf.manifest.shards("curated")]
    for how in ("truncate", "flip"):
        data = open(path, "rb").read()
        if how == "truncate":
            os.truncate(path, len(data) // 2)
        else:  # a byte of the footer (Thrift metadata): undecodable
            flip_byte(path, len(data) - 8 - int.from_bytes(data[-8:-4], "little") // 2)
        with pytest.raises(RollstoreError) as err:
            read_curated(curated)
        msg = str(err.value)
        assert path in msg and "cannot be read" in msg and "\n" not in msg, msg
        open(path, "wb").write(data)


@pytest.mark.parametrize("how", TAMPERS)
def test_every_command_against_a_damaged_referenced_shard(cli, thin, tmp_path, how):
    """The table of docs/integrity.md §What each command verifies, row by row: verify, export,
    curate and train refuse; sql checks place and size only (documented), so a same-size tamper or
    a flipped byte is read (or fails naming the file) while a truncated or linked shard is refused."""
    path = referenced(thin)
    words = tamper(path, how, tmp_path)
    res = cli("verify", thin)
    assert res.code == 1 and path in res.stderr and words in res.stderr, res.stderr
    for args in (["export", thin, "--to", tmp_path / "x"], ["curate", thin, "--recipe", "dapo", "--set", "where=true"],
                 ["train", thin, "--model", "builtin:tiny"]):
        seq = seq_of(thin)
        line = one_error_line(cli(*args))
        assert path in line and words in line, (args, line)
        assert seq_of(thin) == seq
    assert not os.path.exists(tmp_path / "x")
    with Buffer.open(thin) as buf:
        cid = buf.manifest.shards("curations")[0].key
    assert cli("audit", thin).code == 0  # one curation's audit reads its record and audit shards, no rollouts shard
    for args in (["sql", thin, "SELECT count(*) AS n FROM curated", "--format", "csv"],
                 ["audit", thin, cid, "--compare", cid],
                 ["curate", thin, "--recipe", "dapo", "--set", "where=true", "--dry-run"]):
        res = cli(*args)
        if how in ("same-size", "flipped-byte"):  # place and size only: read (or a read error naming the file)
            assert res.code == 0 or path in one_error_line(res), (args, res.stderr)
        else:
            assert path in one_error_line(res) and words in res.stderr, (args, res.stderr)


# ---- 3: no non-finite number is ever trained or published ---------------------------------------
def _materialised_curation(root: str, cid: str, bad: str | None) -> list[str]:
    """A materialised (schema version 1) curated shard of tiny-model rows committed by hand, with a
    NaN in `bad` (a column of the learner's rows) at row 3; returns its rollout ids."""
    from rollstore.storage.schema import CURATED

    rows = tiny_rows(7)
    n = rows.num_rows
    cols = {
        "curation_id": pa.array([cid] * n), "rollout_id": rows.column("rollout_id"),
        "group_id": rows.column("group_id"), "prompt_id": rows.column("prompt_id"),
        "policy_version": rows.column("policy_version"), "prompt_token_ids": rows.column("prompt_token_ids"),
        "response_token_ids": rows.column("response_token_ids"), "old_logprobs": rows.column("gen_logprobs"),
        "gen_logprobs": rows.column("gen_logprobs"),
        "advantage": pa.array([1.0 if i % 2 else -1.0 for i in range(n)], pa.float32()),
        "loss_mask": pa.array([[True] * len(r) for r in rows.column("response_token_ids").to_pylist()]),
        "weight": pa.array([1.0] * n, pa.float32()),
    }
    if bad is not None:
        col = cols[bad]
        values = col.to_pylist()
        if isinstance(values[3], list):
            values[3] = [float("nan")] + values[3][1:]
        else:
            values[3] = float("nan")
        cols[bad] = pa.array(values, CURATED.field(bad).type)
    table = pa.table([cols[f.name] for f in CURATED], schema=CURATED)
    with Buffer.open(root) as buf:
        buf.commit([Part("curated", table, key=cid, subdir=cid)], "curate")
    return rows.column("rollout_id").to_pylist()


def _ledger_state(root: str) -> tuple:
    with Buffer.open(root) as buf:
        con = buf.manifest.con
        return (buf.manifest.latest_seq(), con.execute("SELECT count(*) FROM leases").fetchone(),
                len(buf.manifest.shards("checkpoints")))


@pytest.mark.parametrize("bad", ["old_logprobs", "gen_logprobs", "advantage", "weight"])
def test_non_finite_rows_are_refused_before_training(cli, buffer_dir, bad):
    ids = _materialised_curation(buffer_dir, "c-nan", bad)
    state = _ledger_state(buffer_dir)
    line = one_error_line(cli("train", buffer_dir, "--model", "builtin:tiny"))
    assert ids[3] in line and bad in line and "curated/c-nan/" in line and "not a finite number" in line, line
    assert _ledger_state(buffer_dir) == state
    assert not os.listdir(os.path.join(buffer_dir, "checkpoints"))


def test_a_non_finite_step_stops_the_run_naming_curation_shard_and_rollout(buffer_dir, monkeypatch):
    """Past the input checks (here: the model's own log-probs turn NaN at one row), the step's loss
    and gradient norm are checked before the optimiser step; nothing is published."""
    import torch

    from rollstore.learner import consume, trainer
    from rollstore.learner.config import Pending, RunPosition, TrainConfig
    from learner_util import tiny_llama

    ids = _materialised_curation(buffer_dir, "c-step", None)
    real = trainer.response_logprobs

    def poisoned(model, batch, with_entropy=True):
        logp, ent = real(model, batch, with_entropy)
        if ids[5] in batch.rollout_ids:
            logp = logp.clone()
            logp[batch.rollout_ids.index(ids[5]), 0] = float("nan")
        return logp, ent

    monkeypatch.setattr(trainer, "response_logprobs", poisoned)
    model = tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    opt, sched = trainer.make_optimizer(model, lr=1e-3)
    state = _ledger_state(buffer_dir)
    with Buffer.open(buffer_dir) as buf, pytest.raises(trainer.NonFiniteStep) as err:
        consume.train_pending(buf, model, opt, sched, TrainConfig(micro_batch_size=4), at=RunPosition("r", 0, 0),
                              pending=Pending(per="curation"))
    msg = str(err.value)
    assert "curation c-step" in msg and "curated/c-step/" in msg and ids[5] in msg and "\n" not in msg, msg
    assert "first non-finite: the model's log-probs" in msg, msg  # from the step's own training forward
    assert _ledger_state(buffer_dir) == state
    # the steps before the bad one were applied in memory; none after it, and no NaN in the weights
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert before  # (the in-memory model is the caller's; nothing of it was published)


# ---- 2: use caps hold under concurrent curations -------------------------------------------------
def _uses_hold(root: str, cap: int) -> tuple[int, list[str]]:
    """(live curations, violations): every audit row's `uses` must equal the number of live
    curations committed before its own that selected the row, and no row is selected more than
    `cap` times in all."""
    with Buffer.open(root) as buf:
        records = sorted(buf.manifest.shards("curations"), key=lambda s: s.added_seq)
        audits = {s.key: os.path.join(root, s.path) for s in buf.manifest.shards("selections")}
    times: dict[str, int] = {}
    wrong = []
    for rec in records:
        audit = pq.read_table(audits[rec.key], columns=["rollout_id", "uses", "selected"]).to_pylist()
        for row in audit:
            if row["uses"] != times.get(row["rollout_id"], 0):
                wrong.append(f"{rec.key}: {row['rollout_id']} uses={row['uses']}, "
                             f"selected before: {times.get(row['rollout_id'], 0)}")
        for row in audit:
            if row["selected"]:
                times[row["rollout_id"]] = times.get(row["rollout_id"], 0) + 1
    wrong += [f"{rid} selected {n} times (cap {cap})" for rid, n in times.items() if n > cap]
    return len(records), wrong


def _concurrent_trials(root: str, trials: int, width: int, cap: int, monkeypatch, retry: bool = True) -> dict:
    """`trials` rounds of `width` replay-window curations of one fresh step (each its own where
    text, so its own curation id) over the same window, all deciding on the same snapshot before
    any commits (a barrier in front of the commit); the refused ones curate again, one after the
    other (in every 4th trial: the others leave them refused). Returns counts."""
    import threading

    from rollstore.curate import finish
    from rollstore.curate.params import CurationError, load_recipe
    from rollstore.curate.run import curate

    recipe = load_recipe("replay-window")
    real = finish.publish
    gate: dict = {}

    def gated(*args, **kwargs):
        barrier = gate.get("barrier")
        if barrier is not None:
            barrier.wait(timeout=60)
        return real(*args, **kwargs)

    monkeypatch.setattr(finish, "publish", gated)
    counts = {"committed_at_once": 0, "refused": 0, "retried": 0}
    with Buffer.open(root) as buf:
        step = buf.manifest.latest_seq()
    for t in range(trials):
        step = 1 + t
        with Buffer.open(root) as buf:
            buf.append_rollouts(tiny_rows(100 + t, step=step, n_groups=2, group_size=4))
        sets = [{"where": f"step = {step} AND group_id <> 'x{k}'", "current_version": step,
                 "replay_max_uses": cap} for k in range(width)]
        gate["barrier"] = threading.Barrier(width)
        outcome: list = [None] * width

        def one(k):
            try:
                with Buffer.open(root) as b:
                    outcome[k] = curate(b, recipe, sets[k])
            except CurationError as exc:
                outcome[k] = exc
                gate["barrier"].abort()

        threads = [threading.Thread(target=one, args=(k,)) for k in range(width)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        gate["barrier"] = None
        for k, res in enumerate(outcome):
            if isinstance(res, Exception):
                assert "committed meanwhile" in str(res) and "\n" not in str(res), res
                counts["refused"] += 1
                if retry and t % 4 == 0:  # every 4th trial: the refused ones commit on a retry (fast test)
                    with Buffer.open(root) as b:
                        assert curate(b, recipe, sets[k]).committed
                    counts["retried"] += 1
            else:
                assert res.committed and not res.already_existed
                counts["committed_at_once"] += 1
    return counts


@pytest.mark.parametrize("width", [2, 3])
def test_replay_use_caps_hold_under_concurrent_curations(tmp_path, monkeypatch, width):
    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        buf.append_rollouts(tiny_rows(99, step=0, n_groups=2, group_size=4))
    trials = 20
    counts = _concurrent_trials(root, trials, width, 2, monkeypatch)
    n, wrong = _uses_hold(root, 2)
    assert wrong == [], wrong[:5]
    assert counts["committed_at_once"] == trials  # one per trial wins the race; the others see it
    assert counts["refused"] == trials * (width - 1)
    assert counts["retried"] == 5 * (width - 1) and n == trials + counts["retried"]  # a retry commits


def test_without_the_commit_check_concurrent_curations_break_the_cap(tmp_path, monkeypatch):
    """The harness sees the failure the check prevents (the red team's finding)."""
    from rollstore.curate import publish

    monkeypatch.setattr(publish, "selected_meanwhile", lambda *a: None)
    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        buf.append_rollouts(tiny_rows(99, step=0, n_groups=2, group_size=4))
    _concurrent_trials(root, 2, 3, 2, monkeypatch, retry=False)
    _, wrong = _uses_hold(root, 2)
    assert any("cap 2" in w for w in wrong) and any("uses=" in w for w in wrong), wrong


def register_by_hand(root: str, table: pa.Table) -> str:
    """A rollouts file put in place and named in the manifest without rollstore's import (what the
    red team did): no validation at all. Returns its path."""
    from rollstore.storage.buffer import stored_table, token_count
    from rollstore.storage.manifest import NewShard
    from rollstore.storage.shardio import sha256_file

    rel = "rollouts/by-hand.parquet"
    full = os.path.join(root, rel)
    stored = stored_table(Part("rollouts", table))
    pq.write_table(stored, full)
    with Buffer.open(root) as buf, buf.manifest.transaction() as con:
        seq = buf.manifest.new_commit(con, "append", {"source": "by hand"})
        ids = buf.manifest.add_shards(con, seq, [NewShard("rollouts", rel, stored.num_rows, token_count(stored),
                                                          os.path.getsize(full), sha256_file(full))])
        rids = stored.column("rollout_id").to_pylist()
        gids = stored.column("group_id").to_pylist()
        buf.manifest.register_rollouts(con, ids[0], zip(rids, gids), list(dict.fromkeys(gids)))
    return full


def _with_nan(table: pa.Table, column: str, row: int) -> pa.Table:
    values = table.column(column).to_pylist()
    if isinstance(values[row], list):
        values[row] = values[row][:1] + [float("nan")] + values[row][2:]
    else:
        values[row] = float("inf")
    field = table.schema.field(column)
    return table.set_column(table.column_names.index(column), field, pa.array(values, field.type))


@pytest.mark.parametrize("column,recipe", [("reward", "grpo"), ("reward", "replay-window"),
                                           ("entropies", "d3s")])
def test_curation_refuses_non_finite_rows_registered_by_hand(cli, buffer_dir, column, recipe):
    table = tiny_rows(11, step=1)
    for row in range(table.num_rows) if column == "entropies" else [5]:  # entropies: of whichever row is selected
        table = _with_nan(table, column, row)
    with Buffer.open(buffer_dir) as buf:
        buf.append_rollouts(tiny_rows(12, step=0))
    path = register_by_hand(buffer_dir, table)
    seq = seq_of(buffer_dir)
    sets = ["--set", "where=step = 1"] + (["--set", "current_version=1"] if recipe.startswith("replay") else [])
    line = one_error_line(cli("curate", buffer_dir, "--recipe", recipe, *sets))
    assert repr(column) in line and ("NaN" in line or "finite" in line), line
    if column == "reward":
        assert path in line and table.column("rollout_id")[5].as_py() in line
    assert seq_of(buffer_dir) == seq


@pytest.mark.parametrize("column", ["reward", "gen_logprobs", "old_logprobs", "entropies"])
def test_every_rollouts_shard_a_commit_writes_is_checked_finite(buffer_dir, column):
    """The Python path past import (`Buffer.commit` with a rollouts Part) is closed too."""
    from rollstore.storage.errors import ValidationError

    table = tiny_rows(13)
    if column == "old_logprobs":
        table = table.set_column(table.column_names.index("old_logprobs"), table.schema.field("old_logprobs"),
                                 table.column("gen_logprobs").cast(table.schema.field("old_logprobs").type))
    bad = _with_nan(table, column, 2)
    with Buffer.open(buffer_dir) as buf:
        with pytest.raises(ValidationError) as err:
            buf.commit([Part("rollouts", bad)], "append")
        assert column in str(err.value) and bad.column("rollout_id")[2].as_py() in str(err.value)
        assert buf.manifest.shards("rollouts") == []
    assert [f for f in os.listdir(os.path.join(buffer_dir, "rollouts")) if f.endswith(".parquet")] == []


# ---- 4: every curation parameter has a range rule ------------------------------------------------
NONSENSE = ["-5", "-1", "1e30", "-1e30", "1e400", "99999999999999999999", "0.1234567890123456789012345678901234567890",
            "abc", "nan", "inf", "-inf", "", "true", 10**30, -7, 1e308, float("nan"), float("inf"), [1, 2], {"a": 1},
            True]
# what NONSENSE holds that is in range for a parameter (where: any text is an SQL predicate, refused
# when it runs, as `test_where_nonsense_is_one_line` checks)
IN_RANGE = {"where": {"-5", "-1", "1e30", "-1e30", "1e400", "99999999999999999999",
                      "0.1234567890123456789012345678901234567890", "abc", "nan", "inf", "-inf", "true"}}


def test_every_parameter_of_every_recipe_has_a_range_rule():
    """Every parameter any recipe takes, with every nonsense value (out of range, huge, negative,
    wrong type): a one-line error naming the parameter, unless listed in range above. A parameter
    added without a rule fails here."""
    from rollstore.curate.params import DEFAULTS, ParamError, builtin_recipes, load_recipe, resolve

    accepted = []
    for recipe in map(load_recipe, builtin_recipes()):
        for name in DEFAULTS:
            for value in NONSENSE:
                try:
                    resolve(recipe, {name: value})
                except ParamError as exc:
                    msg = str(exc)
                    assert f"parameter {name}" in msg and "\n" not in msg, (recipe.name, name, value, msg)
                    continue
                if not (isinstance(value, str) and value in IN_RANGE.get(name, ())):
                    accepted.append((recipe.name, name, value))
    assert accepted == []


@pytest.mark.parametrize("value,needle", [("1e30", "at most 1e18"), ("-5", "≥ 0"), ("99999999999999999999", "1e18"),
                                          ("1.5", "integer"), ("nan", "finite")])
def test_current_version_nonsense_is_a_parameter_error(cli, thin, value, needle):
    line = one_error_line(cli("curate", thin, "--recipe", "replay-window", "--set", f"current_version={value}"))
    assert "parameter current_version" in line and needle in line and "SQL" not in line, line


@pytest.mark.parametrize("recipe,name,value", [
    ("grpo", "current_version", 10**18), ("grpo", "max_policy_lag", 10**18), ("grpo", "max_reuse", 10**18),
    ("da3po", "difficulty_window", 10**18), ("da3po", "difficulty_prior", "1e18"), ("da3po", "amplify_max", "1e18"),
    ("da3po", "amplify_tau", "1e-18"), ("replay-rollouts", "replay_window", 10**18),
    ("replay-rollouts", "replay_max_uses", 10**18), ("replay-rollouts", "replay_count", 10**18),
    ("replay-rollouts", "replay_decay", "1e-18"), ("pods", "sample_fraction", "1e-18"),
    ("d3s", "progress", "1e-18"), ("entropy-top", "token_fraction", "1e-18"),
])
def test_the_extremes_of_every_range_run(thin, recipe, name, value):
    """The largest and finest values a rule lets through bind and run (a dry run) without an
    overflow in SQL."""
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate

    sets = {name: value, "where": "step = 1"}
    if recipe.startswith("replay") and name != "current_version":
        sets["current_version"] = 1
    with Buffer.open(thin) as buf:
        assert curate(buf, load_recipe(recipe), sets, dry_run=True).record["n_candidates"] > 0


@pytest.mark.parametrize("where", ["1e30", "abc", "nan", "true) UNION ALL SELECT 1 --"])
def test_where_nonsense_is_one_line(cli, thin, where):
    line = one_error_line(cli("curate", thin, "--recipe", "grpo", "--set", f"where={where}"))
    assert "where" in line, line


def test_the_trl_plugin_verifies_the_rows_it_replays(thin, tmp_path):
    """`trl_replay.stored_rows` (what the TRL plug-in trains replayed rows from) hashes the rollouts
    shards before it reads a row: a same-size rewrite is one line naming the file."""
    from types import SimpleNamespace

    from rollstore.storage.verify import ShardError

    pytest.importorskip("trl")
    from rollstore.trl import replay as trl_replay

    path = referenced(thin)
    same_size_tamper(path)
    with Buffer.open(thin) as buf:
        tr = SimpleNamespace(rollstore_buffer=buf, rollstore_run_id="run-0", num_generations=4)
        with pytest.raises(ShardError) as err:
            trl_replay.stored_rows(tr, [{"rollout_id": "x", "advantage": 1.0, "weight": 1.0, "loss_mask": [1]}])
    assert path in str(err.value) and "sha256 differs" in str(err.value)


def test_train_verify_bench_smoke(tmp_path):
    """bench/train_verify.py at a tiny size, in this process: both modes train and publish, the
    table has its rows."""
    from bench import train_verify

    import torch

    root = str(tmp_path / "buf")
    info = train_verify.prepare(root, 4000, 2, 16, "d3s", "0")
    threads = torch.get_num_threads()
    try:
        m = {**train_verify.child(root, 1), **info, "recipe": "d3s", "progress": "0", "repeat": 1, "mean_tokens": 16}
    finally:
        torch.set_num_threads(threads)
    text = train_verify.section(m, command="python -m bench.train_verify --tokens 4000")
    assert "| **median** |" in text and info["rollouts_shards"] == 2 and len(m["runs"]["with"]) == 1
    with Buffer.open(root) as buf:
        assert len(buf.manifest.shards("checkpoints")) == 2  # one per run, each under its own run id
