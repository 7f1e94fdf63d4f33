"""One store interface (issue 48, item 2): the same checks against the folder store and the S3 store
(moto's server on 127.0.0.1), and the verified cache as a decorator of either.
The S3 half skips with one line when moto's server is missing."""

from __future__ import annotations

import hashlib
import os

import pytest

import s3_server
from conftest import serving
from rollstore.storage.store import FolderStore, ObjectDamaged, ObjectMissing, S3Store, Store, VerifiedCache


@pytest.fixture(scope="module")
def s3():
    yield from serving(s3_server, "S3 store tests")


@pytest.fixture(params=["folder", "s3"])
def store(request, tmp_path, monkeypatch) -> Store:
    if request.param == "folder":
        return FolderStore(str(tmp_path / "objects"))
    server = request.getfixturevalue("s3")
    for k, v in s3_server.environment(server).items():
        monkeypatch.setenv(k, v)
    return S3Store(server.fresh_url())


def _file(tmp_path, name: str, body: bytes) -> tuple[str, str]:
    path = tmp_path / name
    path.write_bytes(body)
    return str(path), hashlib.sha256(body).hexdigest()


def test_every_store_puts_once_reads_lists_and_deletes(store, tmp_path):
    local, digest = _file(tmp_path, "a.bin", b"x" * 3000)
    store.put_if_absent("rollouts/a.parquet", local)
    other, _ = _file(tmp_path, "b.bin", b"other bytes")
    with pytest.raises(FileExistsError):
        store.put_if_absent("rollouts/a.parquet", other)  # the first object stays
    assert b"".join(store.read("rollouts/a.parquet")) == b"x" * 3000
    assert [(rel, size) for rel, _t, size in store.list()] == [("rollouts/a.parquet", 3000)]
    assert store.read_small("rollouts/a.parquet") == b"x" * 3000
    store.delete("rollouts/a.parquet")
    assert store.read_small("rollouts/a.parquet") is None and list(store.list()) == []
    with pytest.raises(ObjectMissing):
        b"".join(store.read("rollouts/a.parquet"))


def test_fetch_verifies_and_keeps_nothing_wrong(store, tmp_path):
    local, digest = _file(tmp_path, "a.bin", b"shard bytes")
    store.put_if_absent("rollouts/a.parquet", local)
    cache = str(tmp_path / "cache")
    got = store.fetch(cache, "rollouts/a.parquet", digest, len(b"shard bytes"))
    assert got == os.path.join(cache, "rollouts/a.parquet") and open(got, "rb").read() == b"shard bytes"
    with pytest.raises(ObjectDamaged, match="not cached"):
        store.fetch(str(tmp_path / "cache2"), "rollouts/a.parquet", "0" * 64, len(b"shard bytes"))
    assert not os.path.exists(tmp_path / "cache2" / "rollouts" / "a.parquet")
    assert os.listdir(tmp_path / "cache2" / "tmp") == []  # the download's temporary file is gone too
    with pytest.raises(ObjectMissing, match="rollstore verify .* --quarantine"):
        store.fetch(cache, "rollouts/none.parquet", digest, 1)


def test_the_verified_cache_decorates_a_store(store, tmp_path):
    local, digest = _file(tmp_path, "a.bin", b"cached bytes")
    cached = VerifiedCache(store)
    cached.put_if_absent("rollouts/a.parquet", local)  # through to the store
    assert [rel for rel, _t, _s in store.list()] == ["rollouts/a.parquet"]
    root = str(tmp_path / "cache")
    first = cached.fetch(root, "rollouts/a.parquet", digest, len(b"cached bytes"))
    cached.delete("rollouts/a.parquet")  # gone from the store: the cache answers from its verified copy
    assert cached.fetch(root, "rollouts/a.parquet", digest, len(b"cached bytes")) == first
    with pytest.raises(ObjectMissing):
        store.fetch(str(tmp_path / "elsewhere"), "rollouts/a.parquet", digest, len(b"cached bytes"))
