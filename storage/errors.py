"""Error types of the store. Each renders as one line naming the file, the row and the column."""

from __future__ import annotations


class RollstoreError(Exception):
    """Base class: a user-facing error whose str() is one line."""


class ValidationError(RollstoreError):
    """A row of an append broke a rule of docs/schema.md §Validation at append; nothing of the
    append was written."""

    def __init__(self, file: str, rollout_id: str | None, column: str | None, message: str):
        self.file, self.rollout_id, self.column, self.message = file, rollout_id, column, message
        row = f"row rollout_id={rollout_id!r}" if rollout_id is not None else "row ?"
        col = f"column {column!r}" if column else "column ?"
        super().__init__(f"{file}: {row}: {col}: {message}")


class ManifestError(RollstoreError):
    """The buffer or its manifest is missing, locked or inconsistent."""
