"""Shared fixtures of the rollout/learner tests: a session tiny-model cache and small models.

Import the fixtures into a test module (`from rollout_helpers import tiny_cache, default_tiny`)
so every module shares one cache directory and the default warm start is paid once per session.
"""

from __future__ import annotations

import os

import pytest

SMALL_STEPS = 5  # warm-start steps for tests that need a built model but assert no accuracy


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """ROLLSTORE_CACHE pointed at one temporary directory for the whole session (never ~/.cache)."""
    path = str(tmp_path_factory.getbasetemp() / "rollstore-cache")
    old = os.environ.get("ROLLSTORE_CACHE")
    os.environ["ROLLSTORE_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("ROLLSTORE_CACHE", None)
    else:
        os.environ["ROLLSTORE_CACHE"] = old


@pytest.fixture(scope="session")
def default_tiny(tiny_cache):
    """The default builtin:tiny (full warm start), built once per session into the test cache."""
    from rollstore.builtin.resolve import resolve_model

    return resolve_model("builtin:tiny", quiet=True)


@pytest.fixture(scope="session")
def small_tiny(tiny_cache):
    """A tiny policy after a few warm-start steps (its own cache entry): for cache and determinism tests."""
    from rollstore.builtin.resolve import resolve_model

    return resolve_model("builtin:tiny", steps=SMALL_STEPS, quiet=True)


@pytest.fixture(scope="session")
def untrained_tiny(tmp_path_factory):
    """The tiny policy at initialisation: samples pad/bos/eos anywhere (for the EOS-mask tests)."""
    from rollstore.learner.tiny import build_tiny

    path = str(tmp_path_factory.mktemp("untrained-tiny"))
    build_tiny(path, [("1+1=", "2")], steps=0, seed=0)
    return path
