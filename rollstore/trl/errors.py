"""The one error the TRL plug-in raises (`rollstore.trl` and `rollstore.trl.replay`), in a module of
its own so that both can raise it without importing each other."""

from __future__ import annotations

from rollstore.storage.errors import RollstoreError


class TRLPluginError(RollstoreError):
    """The TRL batch cannot be recorded or curated as the plug-in's invariants require."""
