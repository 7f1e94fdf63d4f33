"""The store seam: where a cataloged buffer's shard bytes live when they are not in a shared folder.

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
- A file enters the cache only complete and verified: it is downloaded under `BUF/tmp/`, hashed
  while it streams, compared with the catalog's sha256 and size, fsynced, then renamed into place.
  A mismatch is one line and nothing is cached. A cached file of the right size is trusted (it was
  verified when it entered; `rollstore verify` re-hashes).
- Credentials and the endpoint come from boto3's own places (environment, ~/.aws), never from the
  descriptor; `AWS_ENDPOINT_URL` (or `ROLLSTORE_S3_ENDPOINT`) points at a non-AWS provider.
"""

from __future__ import annotations

import errno
import hashlib
import os
import uuid
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


class S3Store:
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

    def fetch(self, root: str, rel: str, sha256: str, nbytes: int, holding=None) -> str:
        """The local copy of `rel` in the cache at `root`, downloaded and verified when missing.
        `holding(relpath)`: the catalog's intent on the download's temporary file while it is
        written (so a gc of this cache never takes it for an orphan)."""
        final = os.path.join(root, rel)
        try:
            if os.path.getsize(final) == nbytes:
                return final
        except FileNotFoundError:
            pass
        tmp_rel = os.path.join("tmp", owned_name("cache", ".parquet"))
        if holding is None:
            return self._download(root, rel, sha256, nbytes, tmp_rel)
        with holding(tmp_rel):
            return self._download(root, rel, sha256, nbytes, tmp_rel)

    def _download(self, root: str, rel: str, sha256: str, nbytes: int, tmp_rel: str) -> str:
        from botocore.exceptions import BotoCoreError, ClientError

        final = os.path.join(root, rel)
        tmp = os.path.join(root, tmp_rel)
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        h = hashlib.sha256()
        size = 0
        try:
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))["Body"]
                with open(tmp, "wb") as out:
                    for block in iter(lambda: body.read(1 << 20), b""):
                        h.update(block)
                        size += len(block)
                        out.write(block)
                    out.flush()
                    os.fsync(out.fileno())
            except ClientError as exc:
                if _missing(exc):
                    raise ObjectMissing(f"{self.url}/{rel}: the object is missing from the store (deleted); restore it, "
                                        f"or run `rollstore verify {root} --quarantine` to retire its shard") from None
                raise self._fail(f"cannot read {rel}", exc) from None
            except BotoCoreError as exc:
                raise self._fail(f"cannot read {rel}", exc) from None
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


def open_store(url: str | None) -> S3Store | None:
    return None if url is None else S3Store(url)
