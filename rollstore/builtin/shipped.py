"""The built-in tiny policies as shipped with the package: installed into the cache instead of a build.

`build_tiny_cached` (rollstore.builtin.resolve) builds a tiny policy on first use, a few minutes of
CPU. For the default settings of each built-in policy the package carries the directory such a
build produced (`models/tiny-<key>/`, about 1.4 MB each), and the first use copies it into the
cache instead. `python -m rollstore.builtin.ship` (`make tiny-models`) rebuilds them.

This module reads the shipped copies and imports nothing of the build (`rollstore.builtin.resolve`
imports it; the rebuilding tool, `rollstore.builtin.ship`, imports both).

Invariants:
- A shipped copy is only ever used for the key it was built for: the directory is named by the
  key, and its `rollstore_tiny.json` (written by the build, untouched) must hold exactly the spec
  that key hashes. A change to the build that changes the spec changes the key, so the shipped
  copy stops matching and the policy is built as before until the copies are rebuilt
  (tests/test_tiny.py fails while a shipped copy is stale).
- `SHIPPED.json` beside the files records each file's sha256 and what built them (library
  versions, machine). The copy is checked after it is copied into the cache's temporary sibling
  directory and only then renamed into place; a missing, extra, altered or mismatched file refuses
  the shipped copy, with one line on stderr, and the policy is built instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile

SHIPPED_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")
MANIFEST = "SHIPPED.json"
TINY_INFO = "rollstore_tiny.json"  # the spec a tiny policy's build wrote beside its files (rollstore.builtin.resolve)


def _sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _files(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f != MANIFEST)


def why_not(path: str, spec: dict) -> str | None:
    """Why the model directory `path` is not a faithful shipped build of `spec`; None when it is."""
    try:
        with open(os.path.join(path, MANIFEST)) as fh:
            manifest = json.load(fh)
        listed = manifest["sha256"]
        if _files(path) != sorted(listed):
            return f"files {_files(path)} are not the {sorted(listed)} it lists"
        for name, digest in sorted(listed.items()):
            if _sha256(os.path.join(path, name)) != digest:
                return f"{name}: sha256 differs from {MANIFEST}"
        with open(os.path.join(path, TINY_INFO)) as fh:
            built = json.load(fh)["spec"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable ({exc})"
    if built != json.loads(json.dumps(spec)):
        return f"built for another spec than this key's ({TINY_INFO})"
    return None


def install(spec: dict, final: str, ref: str) -> bool:
    """Copy the shipped build of `spec` into the cache directory `final`; False when none matches."""
    source = os.path.join(SHIPPED_ROOT, os.path.basename(final))
    if not os.path.isdir(source):
        return False
    tmp = tempfile.mkdtemp(prefix=".tiny-shipped-", dir=os.path.dirname(final))
    try:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        reason = why_not(tmp, spec)
        if reason is not None:
            print(f"{ref}: the shipped copy {source} is refused ({reason}); building it instead",
                  file=sys.stderr, flush=True)
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        try:
            os.rename(tmp, final)
        except OSError:  # another process installed or built it first
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.exists(os.path.join(final, "config.json")):
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True
