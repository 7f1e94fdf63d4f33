"""The store seam: where a buffer's shard bytes live, one interface (`Store`) with two stores and a cache.

- `Store`: what a buffer asks of the place its bytes live: `put_if_absent`, `read` (the bytes of
  an object), `delete`, `list`, and `fetch` (a verified local copy, built on `read`).
- `S3Store`: S3-compatible object storage; `FolderStore`: a folder (a shared mount), whose
  objects are files, placed with a hard link that never overwrites.
- `VerifiedCache`: a decorator of a store: the same operations, and `fetch` answers from the
  host-local copy when it is there (verified when it entered), downloading only what is missing.

A buffer cataloged in PostgreSQL keeps its shards either in its folder (a shared mount every host
sees; no store object, as before) or in S3-compatible object storage (`rollstore init BUF --catalog
postgresql://... --data s3://bucket/prefix`). With a store, `BUF` is a host-local folder: its
descriptor, and a read cache that holds the objects at the same relative paths
(`BUF/rollouts/...parquet`), so DuckDB, Polars and pyarrow keep reading local files (DuckDB's
`httpfs` is not needed).

Invariants:
- An object is written once, with put-if-absent (`If-None-Match: *`): a second writer of one key
  gets FileExistsError and the first object stays. A bucket that does not refuse the second put is
  refused at `init` (one line, nothing written).
- The writer computes the sha256 of the file it uploads; the catalog's shard row records it (and
  the size) in the same transaction as every other row.
- A file enters the cache only complete and verified (`Store.fetch`): it is downloaded under
  `BUF/tmp/`, hashed while it streams, compared with the catalog's sha256 and size, fsynced, then
  renamed into place. A mismatch is one line and nothing is cached. `VerifiedCache` trusts a cached
  file of the right size (it was verified when it entered; `rollstore verify` re-hashes).
- Credentials and the endpoint come from boto3's own places (environment, ~/.aws), never from the
  descriptor; `AWS_ENDPOINT_URL` (or `ROLLSTORE_S3_ENDPOINT`) points at a non-AWS provider.
"""

from __future__ import annotations

import errno
import hashlib
import os
import uuid
from abc import ABC, abstractmethod
from typing import Iterator
from urllib.parse import urlparse

from .errors import ManifestError
from .owners import owned_name

SCHEME = "s3://"


class ObjectDamaged(ManifestError):
    """An object whose bytes are not the ones the catalog records (size or sha256): never cached."""


class ObjectMissing(ManifestError):
    """An object the catalog records that the store says it does not hold (NoSuchKey): deleted."""


MARKER = "buffer.id"  # the data folder's (or the store prefix's) identity marker: see storage/verify.py


def _missing(exc) -> bool:
    """Whether a botocore ClientError is the store saying the key does not exist."""
    err = getattr(exc, "response", {}) or {}
    code = str(err.get("Error", {}).get("Code", ""))
    return code in ("NoSuchKey", "404", "NotFound") or err.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404


def check_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://bucket[/prefix]`, else one line."""
    parsed = urlparse(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme != "s3" or not parsed.netloc:
        raise ManifestError(f"--data {url}: not a store rollstore knows (give s3://bucket/prefix, or leave it out "
                            "for a shared folder)")
    return parsed.netloc, parsed.path.strip("/")


class Store(ABC):
    """Objects keyed by the buffer-relative path of each shard (or checkpoint file)."""

    url: str

    @abstractmethod
    def put_if_absent(self, rel: str, local: str) -> None:
        """Store the bytes of the file `local` as `rel` unless an object is there (FileExistsError)."""

    @abstractmethod
    def read(self, rel: str) -> Iterator[bytes]:
        """The bytes of `rel`, in blocks; `ObjectMissing` when the store holds no such object."""

    @abstractmethod
    def delete(self, rel: str) -> None: ...

    @abstractmethod
    def list(self) -> Iterator[tuple[str, float, int]]:
        """(relative path, last-modified epoch seconds, bytes) of every object."""

    def read_small(self, rel: str) -> bytes | None:
        """The first 4096 bytes of a small object (a marker), or None when the store does not hold it."""
        out = b""
        try:
            for block in self.read(rel):
                out += block
                if len(out) >= 4096:
                    break
        except ObjectMissing:
            return None
        return out[:4096]

    def fetch(self, root: str, rel: str, sha256: str, nbytes: int, holding=None) -> str:
        """A local copy of `rel` at `root/rel`, complete and verified: downloaded under `root/tmp/`
        (with `holding(relpath)`: the catalog's intent on that temporary file while it is written,
        so a gc of `root` never takes it for an orphan), hashed while it streams, compared with the
        catalog's `sha256` and size (`ObjectDamaged`, nothing kept), fsynced, renamed into place."""
        tmp_rel = os.path.join("tmp", owned_name("cache", ".parquet"))
        if holding is None:
            return self._download(root, rel, sha256, nbytes, tmp_rel)
        with holding(tmp_rel):
            return self._download(root, rel, sha256, nbytes, tmp_rel)

    def _download(self, root: str, rel: str, sha256: str, nbytes: int, tmp_rel: str) -> str:
        final = os.path.join(root, rel)
        tmp = os.path.join(root, tmp_rel)
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        h = hashlib.sha256()
        size = 0
        try:
            try:
                with open(tmp, "wb") as out:
                    for block in self.read(rel):
                        h.update(block)
                        size += len(block)
                        out.write(block)
                    out.flush()
                    os.fsync(out.fileno())
            except ObjectMissing as exc:
                raise ObjectMissing(f"{exc}; restore it, or run `rollstore verify {root} --quarantine` to retire "
                                    "its shard") from None
            if size != nbytes or h.hexdigest() != sha256:
                raise ObjectDamaged(f"{self.url}/{rel}: {size} bytes with sha256 {h.hexdigest()[:12]}…, the catalog "
                                    f"records {nbytes} bytes with {sha256[:12]}…; not cached (the object was "
                                    f"changed or damaged); restore it, or run `rollstore verify {root} --quarantine` "
                                    "to retire its shard")
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return final


class VerifiedCache(Store):
    """A store (`inner`) with a host-local cache in front: every operation is the inner store's,
    but `fetch` trusts a local copy of the right size (it was verified when it entered the cache;
    `rollstore verify` re-hashes) and downloads, verified, only what is missing."""

    def __init__(self, inner: Store):
        self.inner = inner
        self.url = inner.url

    def put_if_absent(self, rel: str, local: str) -> None:
        self.inner.put_if_absent(rel, local)

    def read(self, rel: str) -> Iterator[bytes]:
        return self.inner.read(rel)

    def delete(self, rel: str) -> None:
        self.inner.delete(rel)

    def list(self) -> Iterator[tuple[str, float, int]]:
        return self.inner.list()

    def read_small(self, rel: str) -> bytes | None:
        return self.inner.read_small(rel)

    def fetch(self, root: str, rel: str, sha256: str, nbytes: int, holding=None) -> str:
        try:
            if os.path.getsize(os.path.join(root, rel)) == nbytes:
                return os.path.join(root, rel)
        except FileNotFoundError:
            pass
        return self.inner.fetch(root, rel, sha256, nbytes, holding)


class FolderStore(Store):
    """Objects as files under a folder (a mount every host sees). `put_if_absent` links a complete
    file into place (`os.link` never overwrites: a second writer of one path gets FileExistsError);
    nothing is ever rewritten in place."""

    def __init__(self, folder: str):
        self.folder = folder
        self.url = folder.rstrip("/")

    def _path(self, rel: str) -> str:
        return os.path.join(self.folder, rel)

    def put_if_absent(self, rel: str, local: str) -> None:
        final = self._path(rel)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        if os.path.abspath(local) == os.path.abspath(final):
            raise FileExistsError(errno.EEXIST, "the object exists (put-if-absent refused)", final)
        os.link(local, final)  # FileExistsError when there

    def read(self, rel: str) -> Iterator[bytes]:
        try:
            fh = open(self._path(rel), "rb")
        except FileNotFoundError:
            raise ObjectMissing(f"{self.url}/{rel}: the object is missing from the store (deleted)") from None
        with fh:
            yield from iter(lambda: fh.read(1 << 20), b"")

    def delete(self, rel: str) -> None:
        try:
            os.unlink(self._path(rel))
        except FileNotFoundError:
            pass

    def list(self) -> Iterator[tuple[str, float, int]]:
        for dirpath, _dirs, names in os.walk(self.folder):
            for name in names:
                st = os.lstat(os.path.join(dirpath, name))
                yield os.path.relpath(os.path.join(dirpath, name), self.folder), st.st_mtime, st.st_size


class S3Store(Store):
    """Objects under `s3://bucket/prefix/`, keyed by the buffer-relative path of each shard."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.bucket, self.prefix = check_url(url)
        try:
            import boto3
            import botocore.config
        except ImportError:
            raise ManifestError(f"--data {url}: needs boto3 (pip install 'rollstore[s3]')") from None
        endpoint = os.environ.get("ROLLSTORE_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL") or None
        self.client = boto3.client("s3", endpoint_url=endpoint, config=botocore.config.Config(
            retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10, read_timeout=60))

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _fail(self, what: str, exc: BaseException) -> ManifestError:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return ManifestError(f"{self.url}: {what} ({first})")

    def put_if_absent(self, rel: str, local: str) -> None:
        """Upload `local` as the object of `rel` unless one exists (FileExistsError then)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            with open(local, "rb") as body:
                self.client.put_object(Bucket=self.bucket, Key=self.key(rel), Body=body, IfNoneMatch="*")
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "412") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412:
                raise FileExistsError(errno.EEXIST, "the object exists (put-if-absent refused)",
                                      f"{self.url}/{rel}") from None
            raise self._fail(f"cannot write {rel}", exc) from None
        except BotoCoreError as exc:
            raise self._fail(f"cannot write {rel}", exc) from None

    def delete(self, rel: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key(rel))
        except (BotoCoreError, ClientError) as exc:
            raise self._fail(f"cannot delete {rel}", exc) from None

    def list(self):
        """(relative path, last-modified epoch seconds, bytes) of every object under the prefix."""
        from botocore.exceptions import BotoCoreError, ClientError

        start = f"{self.prefix}/" if self.prefix else ""
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                for o in page.get("Contents", []):
                    yield o["Key"][len(start):], o["LastModified"].timestamp(), int(o["Size"])
        except (BotoCoreError, ClientError) as exc:
            raise self._fail("cannot list the objects", exc) from None

    def read(self, rel: str) -> Iterator[bytes]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))["Body"]
            yield from iter(lambda: body.read(1 << 20), b"")
        except ClientError as exc:
            if _missing(exc):
                raise ObjectMissing(f"{self.url}/{rel}: the object is missing from the store (deleted)") from None
            raise self._fail(f"cannot read {rel}", exc) from None
        except BotoCoreError as exc:
            raise self._fail(f"cannot read {rel}", exc) from None

    def read_small(self, rel: str) -> bytes | None:
        """The bytes of a small object (a marker), or None when the store does not hold it."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key(rel))["Body"].read(4096)
        except ClientError as exc:
            if _missing(exc):
                return None
            raise self._fail(f"cannot read {rel}", exc) from None
        except BotoCoreError as exc:
            raise self._fail(f"cannot read {rel}", exc) from None

    def check_conditional_writes(self) -> None:
        """One line unless the bucket is reachable and refuses a second put-if-absent of one key."""
        probe = f".rollstore-probe-{uuid.uuid4().hex}"
        local = None
        try:
            import tempfile

            fd, local = tempfile.mkstemp(prefix="rollstore-probe-")
            os.close(fd)
            self.put_if_absent(probe, local)
            try:
                self.put_if_absent(probe, local)
            except FileExistsError:
                return
            raise ManifestError(f"{self.url}: the bucket does not refuse a second put-if-absent (If-None-Match: *) of "
                                "one key; rollstore needs conditional writes (docs/multihost.md); nothing was written")
        except ManifestError as exc:
            if "conditional writes" in str(exc):
                raise
            raise ManifestError(f"{exc}; nothing was written") from None
        finally:
            if local is not None:
                os.unlink(local)
            try:
                self.delete(probe)
            except ManifestError:
                pass


def cache_shards(root: str, manifest, shards) -> None:
    """A store's buffer (`manifest.store`): the files of `shards` in this host's cache at `root`,
    downloaded and verified when missing. Nothing for a buffer whose shards are in its folder."""
    if manifest.store is not None:
        for s in shards:
            manifest.store.fetch(root, s.path, s.sha256, s.bytes, manifest.holding)


def open_store(url: str | None) -> Store | None:
    """The store of a buffer's `--data` URL behind this host's verified cache (None: the shards are in
    the buffer's folder)."""
    return None if url is None else VerifiedCache(S3Store(url))
