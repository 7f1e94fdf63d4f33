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


class NotABuffer(ManifestError):
    """A path that holds no rollstore buffer (no manifest.sqlite)."""


class CatalogError(ManifestError):
    """The catalog (SQLite or PostgreSQL) failed or could not be reached, in one line. The catalog's
    own errors: a connection translates its driver's (sqlite3, psycopg) into these at its boundary,
    so nothing above `storage/` catches a driver's exception class."""


class CatalogBusy(CatalogError):
    """The catalog is locked or busy (another writer held it past the wait): trying again may work."""


class CatalogConflict(CatalogError):
    """A uniqueness or other constraint of the catalog was violated (e.g. an id already taken)."""


class CatalogDamaged(CatalogError):
    """The catalog is not a rollstore catalog, or is damaged."""


class CatalogReadOnly(CatalogError):
    """A write was asked of a catalog that could only be opened read-only."""


class UnknownName(RollstoreError):
    """A name (a recipe, a parameter, a curation, a table) that is not one of those known."""


def did_you_mean(word: str, known) -> str:
    """` (did you mean 'x'?)` when one of `known` is close to `word` (case ignored), else ``."""
    import difflib

    known = [str(k) for k in known]
    by_lower = {k.lower(): k for k in known}
    if str(word).lower() in by_lower and by_lower[str(word).lower()] != word:
        return f" (did you mean {by_lower[str(word).lower()]!r}?)"
    close = difflib.get_close_matches(str(word).lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


class UnknownCuration(UnknownName):
    """A curation id that names no live curation of the buffer."""


def unknown_curation(root: str, curation_id: str, known) -> UnknownCuration:
    """The one error of a curation id that is not in the buffer at `root` (`known`: its ids), with a
    did-you-mean when one is close, and how to list them; the CLI and the front door raise it alike."""
    known = list(known)
    return UnknownCuration(f"no curation {curation_id!r} in {root}{did_you_mean(curation_id, known)} ({len(known)} "
                           "curations; `rollstore sql BUFFER \"SELECT curation_id, recipe FROM curations\"` lists them)")
