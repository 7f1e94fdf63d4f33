"""Integrity, round two (issue 24): unknown ids, recipes, outputs, read-only and full disks, gc
beside writers, verify like the readers, damaged manifests, schema rules.

Every case goes through the real command line (typer's CliRunner in-process, or a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest

from conftest import ROLLSTORE_BIN, write_jsonl
from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer


def one_error_line(res) -> str:
    """The single stderr line of a refused command (non-zero exit, no traceback)."""
    assert res.code != 0, (res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert lines[0].startswith("error:"), lines[0]
    assert "unexpected" not in lines[0], lines[0]
    return lines[0]


def seq_of(root: str) -> int:
    with Buffer.open(root) as buf:
        return buf.manifest.latest_seq()


@pytest.fixture
def curated(tmp_path, cli):
    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        for v in range(2):
            buf.append_rollouts(rollouts_table(n_groups=6, group_size=4, step=v, policy_version=v, seed=3))
    res = cli("curate", root, "--recipe", "grpo", "--set", "where=true")
    assert res.code == 0, res.stderr
    return root


# ---- 5: an unknown curation id is one line everywhere -----------------------------------------
@pytest.mark.parametrize("args", [
    ["train", "{b}", "--curation", "nosuch"],
    ["train", "{b}", "--curation", "{cid}", "--curation", "nosuch"],
    ["audit", "{b}", "nosuch"],
    ["audit", "{b}", "nosuch", "--rollout", "r0"],
    ["audit", "{b}", "--compare", "nosuch"],
    ["audit", "{b}", "nosuch", "--compare", "{cid}"],
    ["report", "{b}", "--out", "{tmp}/r.html", "--curation", "nosuch"],
])
def test_unknown_curation_id_is_one_line(cli, curated, tmp_path, args):
    with Buffer.open(curated) as buf:
        cid = buf.manifest.shards("curations")[0].key
    seq = seq_of(curated)
    line = one_error_line(cli(*[a.format(b=curated, cid=cid, tmp=tmp_path) for a in args]))
    assert "nosuch" in line
    assert seq_of(curated) == seq
    assert not os.path.exists(tmp_path / "r.html")


# ---- 3 and 15: a recipe file holds only known keys; its sql_file stays next to it --------------
@pytest.mark.parametrize("text,needle", [
    ('sqll = "SELECT 1"\n', "sqll"),
    ('description = "x"\n[parms]\nsample = "pods"\n', "parms"),
    ('[recipe]\nsql = "SELECT rollout_id, 1.0 AS advantage FROM candidates"\n', "recipe"),
    ('[params]\nsampel = "pods"\n', "sampel"),
    ('[params]\n[params.inner]\nx = 1\n', "inner"),
    ('name = 3\n', "name"),
    ('sql = "SELECT rollout_id, 1.0 AS advantage FROM candidates"\nsql_file = "x.sql"\n', "sql_file"),
])
def test_recipe_with_unknown_keys_is_refused(cli, curated, tmp_path, text, needle):
    recipe = tmp_path / "r.toml"
    recipe.write_text(text)
    (tmp_path / "x.sql").write_text("SELECT rollout_id, 1.0 AS advantage FROM candidates")
    seq = seq_of(curated)
    line = one_error_line(cli("curate", curated, "--recipe", str(recipe)))
    assert needle in line and str(recipe) in line
    assert seq_of(curated) == seq
    line = one_error_line(cli("recipes", "--explain", str(recipe)))
    assert needle in line


@pytest.mark.parametrize("sql_file", ["/etc/passwd", "../outside.sql", "/etc/hostname.sql", "sub/../../outside.sql",
                                      "link.sql", "notes.txt"])
def test_recipe_sql_file_is_resolved_next_to_the_recipe(cli, curated, tmp_path, sql_file):
    folder = tmp_path / "recipes"
    folder.mkdir()
    secret = "TOPSECRETTOKEN"
    (tmp_path / "outside.sql").write_text(f"{secret} garbage")
    (folder / "notes.txt").write_text(f"{secret} garbage")
    os.symlink(tmp_path / "outside.sql", folder / "link.sql")
    recipe = folder / "r.toml"
    recipe.write_text(f'sql_file = "{sql_file}"\n')
    res = cli("curate", curated, "--recipe", str(recipe))
    line = one_error_line(res)
    assert "sql_file" in line and secret not in res.stderr + res.stdout
    assert "root:" not in line


def test_recipe_sql_file_next_to_the_recipe_works_from_any_cwd(cli, curated, tmp_path, monkeypatch):
    folder = tmp_path / "recipes"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "mine.sql").write_text("SELECT rollout_id, 1.0 AS advantage FROM candidates")
    (folder / "r.toml").write_text('sql_file = "sub/mine.sql"\n')
    monkeypatch.chdir(tmp_path)
    res = cli("curate", curated, "--recipe", "recipes/r.toml")
    assert res.code == 0, res.stderr


@pytest.mark.parametrize("select,column", [
    ("SELECT rollout_id, 1.0 AS advantage, 2.0 AS advantage FROM candidates", "advantage"),
    ("SELECT rollout_id, rollout_id, 1.0 AS advantage FROM candidates", "rollout_id"),
    ("SELECT rollout_id, 1.0 AS advantage, 1.0 AS weight, 2.0 AS weight FROM candidates", "weight"),
])
def test_custom_recipe_with_a_repeated_column_is_one_line(cli, curated, tmp_path, select, column):
    sql = tmp_path / "twice.sql"
    sql.write_text(select)
    line = one_error_line(cli("curate", curated, "--recipe", str(sql)))
    assert repr(column) in line and "times" in line


# ---- 6 and 7: outputs replace only regular files; a killed export's partial is cleaned ---------
def _specials(tmp_path):
    """Paths holding something other than a regular file: a character device (as root), a FIFO, a
    directory, a symbolic link to a file, a symbolic link to an empty directory."""
    made = {}
    if os.geteuid() == 0:
        dev = tmp_path / "null-device"
        os.mknod(dev, 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 3))
        made["device"] = dev
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    made["fifo"] = fifo
    (tmp_path / "adir").mkdir()
    made["dir"] = tmp_path / "adir"
    (tmp_path / "real.txt").write_text("keep me")
    os.symlink(tmp_path / "real.txt", tmp_path / "link")
    made["link"] = tmp_path / "link"
    (tmp_path / "emptydir").mkdir()
    os.symlink(tmp_path / "emptydir", tmp_path / "dirlink")
    made["dirlink"] = tmp_path / "dirlink"
    return made


def _kind(path) -> int:
    return os.lstat(path).st_mode


@pytest.mark.parametrize("command", [
    ["report", "{b}", "--out", "{p}"],
    ["sql", "{b}", "SELECT 1 AS x", "--out", "{p}"],
    ["sql", "{b}", "SELECT 1 AS x", "--format", "csv", "--out", "{p}"],
    ["sql", "{b}", "SELECT 1 AS x", "--format", "json", "--out", "{p}"],
    ["sql", "{b}", "SELECT 1 AS x", "--format", "parquet", "--out", "{p}"],
    ["export", "{b}", "--to", "{p}"],
])
def test_outputs_never_replace_anything_but_a_regular_file(cli, curated, tmp_path, command):
    out = tmp_path / "outs"
    out.mkdir()
    for name, path in _specials(out).items():
        if command[0] == "export" and name == "dir":
            continue  # an empty directory is what export takes
        before = _kind(path)
        line = one_error_line(cli(*[a.format(b=curated, p=path) for a in command]))
        assert str(path) in line, (name, line)
        assert _kind(path) == before, name  # still the device, FIFO, folder or link it was
    assert (out / "real.txt").read_text() == "keep me"
    assert not [n for n in os.listdir(out) if ".partial-" in n]
    if command[0] != "export":  # a regular file named by the user is replaced, atomically
        (out / "old.txt").write_text("old")
        res = cli(*[a.format(b=curated, p=out / "old.txt") for a in command])
        assert res.code == 0, res.stderr
        assert (out / "old.txt").read_bytes() != b"old"
        assert not [n for n in os.listdir(out) if ".partial-" in n]


KILLED_EXPORT = r"""
import os, signal, sys
sys.path.insert(0, {root!r})
import rollstore.output.export as export
real = export._write_table
def killed(*a, **k):
    real(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)
export._write_table = killed
from rollstore.cli import app
sys.argv = ["rollstore", "export", {buf!r}, "--to", {to!r}]
app()
"""


def test_a_killed_export_leaves_a_partial_that_the_next_export_removes(curated, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    to = str(tmp_path / "exp")
    res = subprocess.run([sys.executable, "-c", KILLED_EXPORT.format(root=root, buf=curated, to=to)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == -9, res.stderr
    left = [n for n in os.listdir(tmp_path) if n.startswith(".exp.partial-")]
    assert len(left) == 1 and not os.path.exists(to)
    from rollstore.storage.owners import owned_name  # a live writer's partial (ours) is kept
    live = tmp_path / (".exp." + owned_name("partial"))
    live.mkdir()
    res = subprocess.run([ROLLSTORE_BIN, "export", curated, "--to", to], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr
    assert os.path.isdir(os.path.join(to, "rollouts"))
    assert sorted(n for n in os.listdir(tmp_path) if ".partial-" in n) == [live.name]


# ---- 1 and 14: gc beside writers; racing identical curations ---------------------------------
PAUSED_CLI = r"""
import os, sys, time
sys.path.insert(0, {root!r})
GO = {go!r}

def pause(tag):
    print(tag, flush=True)
    while not os.path.exists(GO):
        time.sleep(0.02)

{patch}
from rollstore.cli import app
sys.argv = ["rollstore", *{argv!r}]
app()
"""

PAUSE_BEFORE_COMMIT = """
import rollstore.storage.manifest as m
real = m.Manifest.new_commit
def new_commit(self, con, kind, detail=None):
    if kind == "append":
        pause("linked")  # the shard is linked into rollouts/, its row not yet committed
    return real(self, con, kind, detail)
m.Manifest.new_commit = new_commit
"""

PAUSE_IN_TMP = """
import rollstore.storage.shardio as s
real = s.write_parquet
def write_parquet(table, path, *args, **kwargs):
    real(table, path, *args, **kwargs)
    if "/tmp/" in path:
        pause("written")  # the temp file is complete; not yet hashed or linked
s.write_parquet = write_parquet
"""

PAUSE_AFTER_LINKS = """
import rollstore.storage.buffer as b
real = b.publish_file
def publish_file(table, root, relpath, *args, **kwargs):
    out = real(table, root, relpath, *args, **kwargs)
    if relpath.startswith("meta/curations"):
        pause("linked")  # every file of the curation is in place; the commit is next
    return out
b.publish_file = publish_file
"""


def _paused(tmp_path, patch, *argv):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    go = str(tmp_path / f"go-{len(os.listdir(tmp_path))}")
    script = PAUSED_CLI.format(root=root, go=go, patch=patch, argv=list(argv))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc, go


def _rollstore(*argv, timeout=300):
    return subprocess.run([ROLLSTORE_BIN, *map(str, argv)], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def _rows_file(tmp_path, name, seed):
    return write_jsonl(rollouts_table(n_groups=2, group_size=4, step=seed, policy_version=0, seed=seed,
                                      run_id=f"r{seed}"), tmp_path / name)


@pytest.mark.parametrize("patch,tag", [(PAUSE_BEFORE_COMMIT, "linked"), (PAUSE_IN_TMP, "written")])
def test_gc_never_removes_a_live_writers_files(buffer_dir, tmp_path, patch, tag):
    rows = _rows_file(tmp_path, "rows.jsonl", 1)
    writer, go = _paused(tmp_path, patch, "import", buffer_dir, rows)
    assert writer.stdout.readline().strip() == tag, writer.stderr.read()
    gc = subprocess.Popen([ROLLSTORE_BIN, "gc", buffer_dir, "--grace", "0"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    import time
    time.sleep(2.0)  # gc has listed everything by now (or waits for the writer)
    open(go, "w").close()
    out, err = writer.communicate(timeout=300)
    assert writer.returncode == 0, err
    gc_out, gc_err = gc.communicate(timeout=300)
    assert gc.returncode == 0, gc_err
    res = _rollstore("verify", buffer_dir)
    assert res.returncode == 0, res.stderr
    assert "1 shards verified" in res.stdout


def test_imports_beside_gc_lose_nothing(buffer_dir, tmp_path):
    files = [_rows_file(tmp_path, f"rows{i}.jsonl", 10 + i) for i in range(6)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    for f in files:
        procs.append(subprocess.Popen([ROLLSTORE_BIN, "import", buffer_dir, f], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
        for _ in range(2):
            procs.append(subprocess.Popen([ROLLSTORE_BIN, "gc", buffer_dir, "--grace", "0"], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    res = _rollstore("verify", buffer_dir)
    assert res.returncode == 0 and "6 shards verified" in res.stdout, res.stdout + res.stderr


def test_gc_removes_a_dead_writers_temp_files_and_keeps_a_live_ones(cli, buffer_dir):
    from rollstore.storage.owners import owned_name

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    mine = owned_name("tmp", ".parquet")
    theirs = mine.replace(f"-{os.getpid()}-", f"-{int(dead.stdout)}-")
    folder = owned_name("ckpt")
    for name in (mine, theirs):
        open(os.path.join(buffer_dir, "tmp", name), "wb").write(b"x" * 10)
    os.makedirs(os.path.join(buffer_dir, "tmp", folder, "sub"))
    res = cli("gc", buffer_dir, "--grace", "0")
    assert res.code == 0, res.stderr
    assert sorted(os.listdir(os.path.join(buffer_dir, "tmp"))) == sorted([mine, folder])


def test_racing_identical_curations_report_already_committed(curated, tmp_path):
    args = ["curate", curated, "--recipe", "grpo", "--set", "where=step = 1"]
    loser, go = _paused(tmp_path, PAUSE_AFTER_LINKS, *args)
    assert loser.stdout.readline().strip() == "linked", loser.stderr.read()
    winner = _rollstore(*args)  # replaces the loser's (identical, uncommitted) files, then commits
    assert winner.returncode == 0, winner.stderr
    open(go, "w").close()
    out, err = loser.communicate(timeout=300)
    assert loser.returncode == 0, err
    assert "already committed" in out and "unexpected" not in err, (out, err)
    assert out.strip().splitlines()[-1] == winner.stdout.strip().splitlines()[-1]  # the same curation id
    assert _rollstore("verify", curated).returncode == 0


# ---- 12: a damaged or foreign manifest is one clear line for every command ---------------------
def _damage(path: str, how: str) -> None:
    import sqlite3

    size = os.path.getsize(path)
    if how == "garbage":
        open(path, "wb").write(os.urandom(size))
    elif how == "text":
        open(path, "w").write("this is not a database\n" * 100)
    elif how == "truncated":
        os.truncate(path, 1000)
    elif how == "empty":
        os.truncate(path, 0)
    elif how == "pages":  # header page intact, every other page garbage
        with open(path, "r+b") as fh:
            fh.seek(4096)
            fh.write(os.urandom(size - 4096))
    elif how == "foreign":  # a valid SQLite database of something else
        os.unlink(path)
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE notes (x TEXT)")
        con.commit()
        con.close()


DAMAGED_COMMANDS = [
    ["info", "{b}"], ["sql", "{b}", "SELECT 1"], ["audit", "{b}"], ["verify", "{b}"], ["gc", "{b}"],
    ["compact", "{b}"], ["curate", "{b}", "--recipe", "grpo"], ["export", "{b}", "--to", "{tmp}/exp"],
    ["report", "{b}", "--out", "{tmp}/r.html"], ["import", "{b}", "{rows}"], ["train", "{b}"],
    ["verify", "{b}", "--quarantine"], ["init", "{b}"],
]


@pytest.mark.parametrize("how", ["garbage", "text", "truncated", "empty", "pages", "foreign"])
def test_a_damaged_manifest_is_one_line_for_every_command(cli, curated, tmp_path, how):
    man = os.path.join(curated, "manifest.sqlite")
    for side in ("-wal", "-shm"):
        assert not os.path.exists(man + side)
    _damage(man, how)
    damaged = open(man, "rb").read()
    rows = _rows_file(tmp_path, "rows.jsonl", 7)
    for args in DAMAGED_COMMANDS:
        res = cli(*[a.format(b=curated, tmp=tmp_path, rows=rows) for a in args])
        line = one_error_line(res)
        assert "manifest.sqlite" in line and ("damaged" in line or "not a rollstore manifest" in line), (args, line)
        assert "backup" in line, line
    assert open(man, "rb").read() == damaged  # nothing wrote over it
    assert not os.path.exists(tmp_path / "exp") and not os.path.exists(tmp_path / "r.html")


# ---- 8 and 9: reads work on a really full disk and on a read-only buffer ------------------------
def _can_mount() -> bool:
    return os.geteuid() == 0 and subprocess.run(["which", "mount"], capture_output=True).returncode == 0


@pytest.fixture
def small_fs(tmp_path):
    """A 24 MiB tmpfs mounted by the test (needs root and mount; skipped otherwise)."""
    if not _can_mount():
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _buffer_on(folder, cli) -> str:
    root = str(folder / "buf")
    with Buffer.init(root) as buf:
        for v in range(2):
            buf.append_rollouts(rollouts_table(n_groups=6, group_size=4, step=v, policy_version=v, seed=3))
    assert cli("curate", root, "--recipe", "grpo", "--set", "where=true").code == 0
    for side in ("-wal", "-shm"):  # every connection closed: SQLite must create these to read WAL
        assert not os.path.exists(os.path.join(root, "manifest.sqlite" + side))
    return root


READS = [["info", "{b}"], ["sql", "{b}", "SELECT count(*) FROM rollouts"], ["audit", "{b}"], ["verify", "{b}"],
         ["audit", "{b}", "--format", "json"], ["report", "{b}", "--out", "{out}/r-{n}.html"],
         ["export", "{b}", "--to", "{out}/exp-{n}"], ["sql", "{b}", "SELECT * FROM groups", "--format", "csv"]]


def _reads_work(cli, root, out):
    for n, args in enumerate(READS):
        res = cli(*[a.format(b=root, out=out, n=n) for a in args])
        assert res.code == 0, (args, res.stderr)
        assert not res.stderr.strip() or args[0] in ("report", "export"), res.stderr


def test_reads_work_on_a_really_full_disk(cli, small_fs, tmp_path):
    root = _buffer_on(small_fs, cli)
    from rollstore.storage.owners import owned_name

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = os.path.join(root, "tmp", owned_name("tmp", ".parquet").replace(f"-{os.getpid()}-", f"-{dead.stdout.strip()}-"))
    with open(orphan, "wb") as fh:
        fh.write(b"o" * 100_000)
    os.utime(orphan, (0, 0))
    fd = os.open(small_fs / "fill", os.O_WRONLY | os.O_CREAT)  # fill the filesystem to the last byte
    for block in (65536, 4096, 1):
        try:
            while True:
                os.write(fd, b"\0" * block)
        except OSError:
            pass
    os.close(fd)
    assert os.statvfs(small_fs).f_bavail == 0
    _reads_work(cli, root, tmp_path)
    line = one_error_line(cli("import", root, _rows_file(tmp_path, "rows.jsonl", 9)))
    assert "no space left on device" in line.lower() or "disk is full" in line, line
    res = cli("gc", root, "--grace", "0")  # collecting orphans frees space, even now
    assert res.code == 0, res.stderr
    assert not os.path.exists(orphan)
    os.unlink(small_fs / "fill")
    res = cli("verify", root)
    assert res.code == 0 and "5 shards verified" in res.stdout  # nothing lost: 2 rollouts + curated, audit, record


def _make_read_only(root: str, mnt) -> None:
    if os.geteuid() == 0:
        res = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot remount read-only: {res.stderr.strip()}")
    else:
        subprocess.run(["chmod", "-R", "a-w", root], check=True)


@pytest.fixture
def read_only_buffer(tmp_path, cli):
    """A buffer on a read-only mount (as root), or with every file read-only (otherwise)."""
    if os.geteuid() == 0:
        if not _can_mount():
            pytest.skip("root without mount: permissions do not bind root")
        mnt = tmp_path / "ro"
        mnt.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    else:
        mnt = tmp_path / "ro"
        mnt.mkdir()
    root = str(mnt / "buf")
    try:
        _buffer_on(mnt, cli)
        _make_read_only(root, mnt)
        yield root
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        else:
            subprocess.run(["chmod", "-R", "u+w", root])


def test_a_read_only_buffer_reads_audits_reports_and_exports(cli, read_only_buffer, tmp_path):
    root = read_only_buffer
    before = sorted(os.listdir(root))
    _reads_work(cli, root, tmp_path)
    assert os.path.isdir(tmp_path / f"exp-{6}" / "rollouts")
    for args in (["import", root, _rows_file(tmp_path, "rows.jsonl", 9)], ["curate", root, "--recipe", "dapo"],
                 ["gc", root, "--grace", "0"], ["compact", root, "--small-mb", "100"],
                 ["verify", root, "--quarantine"]):
        res = cli(*args)
        if args[-1] == "--quarantine" and res.code == 0:  # nothing to quarantine: nothing written
            continue
        line = one_error_line(res)
        assert "read-only" in line or "permission" in line.lower(), (args, line)
    assert sorted(os.listdir(root)) == before


# ---- 10: verify applies the readers' rule -----------------------------------------------------
@pytest.mark.parametrize("how", ["file-link-outside", "file-link-inside", "folder-link"])
def test_verify_refuses_what_readers_refuse(cli, curated, tmp_path, how):
    import shutil

    with Buffer.open(curated) as buf:
        shard = buf.manifest.shards("rollouts")[0]
    path = os.path.join(curated, shard.path)
    if how == "folder-link":  # the whole rollouts/ folder moved out and linked back
        outside = tmp_path / "elsewhere"
        shutil.move(os.path.join(curated, "rollouts"), outside)
        os.symlink(outside, os.path.join(curated, "rollouts"))
    else:
        copy = tmp_path / "copy.parquet" if how == "file-link-outside" else os.path.join(curated, "tmp", "copy")
        shutil.copyfile(path, copy)  # identical bytes: size and sha256 match
        os.unlink(path)
        os.symlink(copy, path)
    res = cli("sql", curated, "SELECT count(*) FROM rollouts")
    read_line = one_error_line(res)
    res = cli("verify", curated)
    assert res.code == 1 and path in res.stderr and "symbolic link" in res.stderr, res.stderr
    assert "symbolic link" in read_line
    with Buffer.open(curated) as buf:
        cid = buf.manifest.shards("curations")[0].key
    # (a curation of every row reads the linked shard; one of the latest step reads only that step's)
    for args in (["curate", curated, "--recipe", "dapo", "--set", "where=true"], ["audit", curated, cid, "--compare", cid],
                 ["export", curated, "--to", tmp_path / "x"]):
        one_error_line(cli(*args))
    assert cli("audit", curated).code == 0  # one curation's audit reads its own shards, no rollouts shard


# ---- 4: a row id covers everything that makes the row, also what is not in the file's bytes -----
def test_byte_identical_nemo_rl_dumps_of_two_steps_are_both_imported(cli, buffer_dir, tmp_path):
    from test_importers import EOS, nemo_file
    from rollstore.learner.tiny import build_tokenizer

    tok = tmp_path / "tok"
    build_tokenizer().save_pretrained(str(tok))
    first = nemo_file(tmp_path, 3, [([1, 5], [6, EOS], 1.0), ([1, 5], [7, EOS], 0.0)])
    other = tmp_path / "other"
    other.mkdir()
    second = str(other / "train_data_step4.jsonl")
    open(second, "wb").write(open(first, "rb").read())  # the same bytes, another step
    res = cli("import", buffer_dir, first, second, "--from", "nemo-rl", "--correct-threshold", "1", "--tokenizer", tok)
    assert res.code == 0, res.stderr
    assert res.stdout.count("2 new rows, 0 already present") == 2, res.stdout
    res = cli("sql", buffer_dir, "SELECT step, count(*) AS n FROM rollouts GROUP BY step ORDER BY step", "--format", "csv")
    assert res.stdout.split() == ['"step","n"', "3,2", "4,2"], res.stdout
    again = cli("import", buffer_dir, second, "--from", "nemo-rl", "--correct-threshold", "1", "--tokenizer", tok)
    assert "0 new rows, 2 already present" in again.stdout  # re-importing a file still adds nothing


# ---- 12: token ids the model cannot embed are one line naming the rollout and the id ------------
def test_token_ids_beyond_the_vocabulary_are_one_line_and_nothing_is_trained(cli, tmp_path):
    import pyarrow.compute as pc

    root = str(tmp_path / "buf")
    table = rollouts_table(n_groups=4, group_size=4, step=0, policy_version=0, seed=1)
    ids = table.column("response_token_ids").to_pylist()
    ids = [[min(t, 20) for t in row] for row in ids]  # the tiny model has 24 ids
    ids[5][1] = 24  # one id at the vocabulary size
    table = table.set_column(table.column_names.index("response_token_ids"), "response_token_ids",
                             pa.array(ids, table.schema.field("response_token_ids").type))
    with Buffer.init(root) as buf:
        buf.append_rollouts(table)
    bad = table.column("rollout_id")[5].as_py()
    assert cli("curate", root, "--recipe", "grpo").code == 0
    seq = seq_of(root)
    line = one_error_line(cli("train", root, "--model", "builtin:tiny"))
    assert bad in line and "token id 24" in line and "response_token_ids" in line and "vocabulary size 24" in line
    assert seq_of(root) == seq


# ---- schema rules stated by this issue: counts from 0, ids visible and not blank -----------------
def _rows():
    table = rollouts_table(n_groups=2, group_size=3, step=2, policy_version=1, seed=5)
    return table, table.to_pylist()


@pytest.mark.parametrize("column,value,needle", [
    ("step", -1, "negative"), ("policy_version", -1, "negative"), ("sample_idx", -1, "negative"),
    ("rollout_id", "   ", "blank id"), ("group_id", "\u3000\t", "blank id"), ("prompt_id", " \u00a0 ", "blank id"),
    ("run_id", "run\u202e1", "U+202E"), ("rollout_id", "r\u200b1", "U+200B"), ("group_id", "g\u2066x\u2069", "U+2066"),
    ("prompt_id", "p\u0000", "U+0000"), ("run_id", "a\nb", "U+000A"), ("rollout_id", "\ufeffr", "U+FEFF"),
    ("group_id", "g\u200d", "U+200D"), ("run_id", "r\u2028", "U+2028"),
])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_schema_rules_for_counts_and_ids(cli, buffer_dir, tmp_path, column, value, needle, fmt):
    table, rows = _rows()
    victim = 4
    if column in ("group_id", "run_id", "step", "policy_version", "prompt_id"):
        for r in rows:  # a group agrees on these: change the whole group
            if r["group_id"] == rows[victim]["group_id"] and column != "group_id":
                r[column] = value
        if column == "group_id":
            old = rows[victim]["group_id"]
            for r in rows:
                if r["group_id"] == old:
                    r[column] = value
    else:
        rows[victim][column] = value
    first = next(i for i, r in enumerate(rows) if r[column] == value)
    if fmt == "jsonl":
        path = write_jsonl(rows, tmp_path / "bad.jsonl")
    else:
        path = str(tmp_path / "bad.parquet")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    line = one_error_line(cli("import", buffer_dir, path))
    assert f"column {column!r}" in line and needle in line, line
    assert repr(rows[first]["rollout_id"]) in line, line
    assert cli("sql", buffer_dir, "SELECT count(*) AS n FROM rollouts", "-f", "json").stdout.strip() == '[{"n": 0}]'
    for ch in ("\u202e", "\u200b", "\u2066", "\ufeff", "\u200d", "\u2028"):
        assert ch not in line  # the error line itself shows them escaped


def test_generate_refuses_a_negative_policy_version(cli, buffer_dir):
    line = one_error_line(cli("generate", buffer_dir, "--policy-version", "-1"))
    assert "--policy-version" in line


def test_a_big_jsonl_import_streams(cli, buffer_dir, tmp_path, monkeypatch):
    """Many chunks (forced small): the same rows, checks and errors as one chunk would give."""
    import rollstore.storage.importer as importer

    monkeypatch.setattr(importer, "JSONL_CHUNK_ROWS", 7)
    table = rollouts_table(n_groups=40, group_size=1, step=0, policy_version=0, seed=9)
    rows = table.to_pylist()
    rows[33]["extra_field"] = 1  # a column first seen in a late chunk is still refused by name
    line = one_error_line(cli("import", buffer_dir, write_jsonl(rows, tmp_path / "x.jsonl")))
    assert "extra_field" in line and "unknown column" in line
    del rows[33]["extra_field"]
    rows[30]["group_id"] = rows[2]["group_id"]  # a repeat across chunks
    rows[30]["sample_idx"] = rows[2]["sample_idx"]
    line = one_error_line(cli("import", buffer_dir, write_jsonl(rows, tmp_path / "y.jsonl")))
    assert "sample_idx" in line and repr(rows[30]["rollout_id"]) in line
    rows = table.to_pylist()
    res = cli("import", buffer_dir, write_jsonl(rows, tmp_path / "z.jsonl"))
    assert res.code == 0, res.stderr
    with Buffer.open(buffer_dir) as buf:
        got = buf.snapshot().arrow("rollouts").to_table()
    assert got.column("rollout_id").to_pylist() == table.column("rollout_id").to_pylist()
    assert got.column("response_token_ids").to_pylist() == table.column("response_token_ids").to_pylist()


@pytest.mark.parametrize("command", [["init", "{p}"], ["demo", "{p}"], ["loop", "{p}", "--iterations", "1"],
                                     ["import", "{p}", "{rows}"]])
def test_buffer_paths_never_replace_a_device_or_fifo(cli, tmp_path, command):
    rows = _rows_file(tmp_path, "rows.jsonl", 3)
    for name, path in _specials(tmp_path).items():
        if name in ("dir", "dirlink"):
            continue
        before = _kind(path)
        one_error_line(cli(*[a.format(p=path, rows=rows) for a in command]))
        assert _kind(path) == before, name
    assert (tmp_path / "real.txt").read_text() == "keep me"
