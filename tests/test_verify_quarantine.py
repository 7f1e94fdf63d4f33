"""A host never retires what it merely cannot see (issue 47, item 2), and the way back:
`verify --quarantine` retires only shards whose bytes were read and found wrong (or missing files
beside the data folder's identity marker), refuses with one line when the data folder is absent,
its marker missing or another buffer's, or no shard could be read; `verify --restore` un-retires
quarantined shards whose bytes verify again. Embedded, PostgreSQL-cataloged and S3 buffers."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer
from rollstore.storage.store import MARKER


def _rollouts(step: int, run_id: str = "q"):
    return rollouts_table(n_groups=2, group_size=2, mean_tokens=4, step=step, run_id=run_id)


def _count(cli, root: str) -> int:
    res = cli("sql", root, "SELECT count(*) AS n FROM rollouts", "--format", "json")
    assert res.code == 0, res.stderr
    return json.loads(res.stdout)[0]["n"]


def _live(root: str) -> int:
    with Buffer.open(root) as buf:
        return len(buf.manifest.shards("rollouts"))


def one_line(res) -> str:
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert res.code != 0 and lines, (res.code, res.stdout, res.stderr)
    return lines[-1]


def test_embedded_corrupt_shard_quarantined_then_restored(cli, buffer_dir):
    with Buffer.open(buffer_dir) as buf:
        shards = [buf.append_rollouts(_rollouts(s)) for s in range(3)]
    path = os.path.join(buffer_dir, shards[1].path)
    original = open(path, "rb").read()
    with open(path, "r+b") as fh:  # same size, other bytes
        fh.seek(len(original) // 2)
        fh.write(bytes(b ^ 0xFF for b in original[len(original) // 2:len(original) // 2 + 8]))
    res = cli("verify", buffer_dir, "--quarantine")
    assert res.code == 0 and "quarantined 1 of" in res.stdout and "--restore" in res.stdout, res.stdout + res.stderr
    assert _live(buffer_dir) == 2 and _count(cli, buffer_dir) == 8
    aside = os.path.join(buffer_dir, "quarantine", shards[1].path)
    res = cli("verify", buffer_dir, "--restore")  # still damaged: left quarantined
    assert res.code == 0 and "restored 0" in res.stdout and "left quarantined" in res.stderr, res.stdout + res.stderr
    with open(aside, "wb") as fh:  # the good bytes back (from a backup)
        fh.write(original)
    res = cli("verify", buffer_dir, "--restore")
    assert res.code == 0 and "restored 1" in res.stdout, res.stdout + res.stderr
    assert _live(buffer_dir) == 3 and _count(cli, buffer_dir) == 12
    assert cli("verify", buffer_dir).code == 0
    with Buffer.open(buffer_dir) as buf:  # its ids are claimed again: a duplicate append is refused
        with pytest.raises(Exception, match="already"):
            buf.append_rollouts(_rollouts(1))


def test_embedded_none_readable_or_folder_absent_is_refused(cli, buffer_dir):
    with Buffer.open(buffer_dir) as buf:
        shards = [buf.append_rollouts(_rollouts(s)) for s in range(2)]
    for s in shards:
        os.unlink(os.path.join(buffer_dir, s.path))
    res = cli("verify", buffer_dir, "--quarantine")
    assert "none of the 2 shards could be read" in one_line(res) and "nothing was quarantined" in one_line(res)
    assert _live(buffer_dir) == 2
    shutil.rmtree(os.path.join(buffer_dir, "rollouts"))
    res = cli("verify", buffer_dir, "--quarantine")
    assert "data folders" in one_line(res) and "absent" in one_line(res)
    assert _live(buffer_dir) == 2


def test_embedded_one_missing_among_readable_is_retired(cli, buffer_dir):
    with Buffer.open(buffer_dir) as buf:
        shards = [buf.append_rollouts(_rollouts(s)) for s in range(3)]
    os.unlink(os.path.join(buffer_dir, shards[0].path))
    res = cli("verify", buffer_dir, "--quarantine")
    assert res.code == 0 and "quarantined 1 of 3" in res.stdout, res.stdout + res.stderr
    assert _live(buffer_dir) == 2


def test_shared_folder_copied_descriptor_retires_nothing(pg, cli, tmp_path):
    """A PostgreSQL-cataloged buffer: a host with the descriptor but not the shards (a copied
    descriptor, a folder not mounted) quarantines nothing, whatever it makes of the folder; the
    marker is not rewritten by `init` there; the real folder still quarantines a bad shard."""
    dsn = pg.fresh_dsn()
    real, other = str(tmp_path / "shared"), str(tmp_path / "elsewhere")
    assert cli("init", real, "--catalog", dsn).code == 0
    assert os.path.exists(os.path.join(real, MARKER))
    with Buffer.open(real) as buf:
        shards = [buf.append_rollouts(_rollouts(s)) for s in range(3)]
    os.makedirs(other)
    shutil.copy(os.path.join(real, "catalog.json"), other)
    res = cli("verify", other, "--quarantine")
    assert "absent" in one_line(res) and "nothing was quarantined" in one_line(res)
    assert cli("init", other, "--catalog", dsn).code == 0  # makes the folders; never the marker
    assert not os.path.exists(os.path.join(other, MARKER))
    res = cli("verify", other, "--quarantine")
    assert MARKER in one_line(res) and "nothing was quarantined" in one_line(res)
    with open(os.path.join(other, MARKER), "w") as fh:  # a marker made up by hand is not the catalog's
        fh.write("0" * 32 + "\n")
    res = cli("verify", other, "--quarantine")
    assert MARKER in one_line(res)
    shutil.copy(os.path.join(real, MARKER), other)  # the real marker, copied too: still nothing read here
    res = cli("verify", other, "--quarantine")
    assert "none of the" in one_line(res)
    assert _live(real) == 3 and cli("verify", real).code == 0
    os.unlink(os.path.join(real, shards[2].path))  # on the host that sees the folder: retired
    res = cli("verify", real, "--quarantine")
    assert res.code == 0 and "quarantined 1 of" in res.stdout, res.stdout + res.stderr
    assert _live(real) == 2


@pytest.fixture(scope="module")
def s3():
    import s3_server
    from conftest import serving

    yield from serving(s3_server, "S3 store tests")


def test_s3_missing_and_changed_objects_named_and_quarantined(pg, s3, cli, tmp_path, monkeypatch):
    import s3_server

    for k, v in s3_server.environment(s3).items():
        monkeypatch.setenv(k, v)
    dsn, url = pg.fresh_dsn(), s3.fresh_url()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with Buffer.init(a, catalog=dsn, data=url) as buf:
        shards = [buf.append_rollouts(_rollouts(s)) for s in range(3)]
    assert cli("init", b, "--catalog", dsn, "--data", url).code == 0  # a host with an empty cache
    bucket, prefix = url[5:].split("/", 1)
    client = s3.client()
    client.delete_object(Bucket=bucket, Key=f"{prefix}/{shards[0].path}")
    client.put_object(Bucket=bucket, Key=f"{prefix}/{shards[1].path}", Body=b"not the shard")
    res = cli("sql", b, "SELECT count(*) FROM rollouts")
    line = one_line(res)
    assert "missing from the store" in line and "--quarantine" in line, line
    res = cli("verify", b)
    assert res.code == 1
    assert "object missing from the store" in res.stderr and "object in the store differs" in res.stderr, res.stderr
    res = cli("verify", b, "--quarantine")
    assert res.code == 0 and "quarantined 2 of" in res.stdout, res.stdout + res.stderr
    assert _count(cli, b) == 4
    client.put_object(Bucket=bucket, Key=f"{prefix}/{shards[1].path}",  # the good bytes back
                      Body=open(os.path.join(a, shards[1].path), "rb").read())
    res = cli("verify", b, "--restore")
    assert res.code == 0 and "restored 1" in res.stdout and "left quarantined" in res.stderr, res.stdout + res.stderr
    assert _count(cli, b) == 8


def test_s3_marker_of_another_prefix_is_refused(pg, s3, cli, tmp_path, monkeypatch):
    import s3_server

    for k, v in s3_server.environment(s3).items():
        monkeypatch.setenv(k, v)
    dsn, url = pg.fresh_dsn(), s3.fresh_url()
    a = str(tmp_path / "a")
    with Buffer.init(a, catalog=dsn, data=url) as buf:
        shards = [buf.append_rollouts(_rollouts(s)) for s in range(2)]
    bucket, prefix = url[5:].split("/", 1)
    client = s3.client()
    client.delete_object(Bucket=bucket, Key=f"{prefix}/{MARKER}")  # not the buffer's prefix any more
    client.delete_object(Bucket=bucket, Key=f"{prefix}/{shards[0].path}")
    shutil.rmtree(os.path.join(a, "rollouts"))
    os.makedirs(os.path.join(a, "rollouts"))
    res = cli("verify", a, "--quarantine")
    assert MARKER in one_line(res) and "nothing was quarantined" in one_line(res)
    assert _live(a) == 2
