"""SQL of rollstore as readable `.sql` files, and the DuckDB session that runs it over a snapshot."""

from __future__ import annotations

from importlib import resources


def load_sql(name: str) -> str:
    """Text of queries/<name>.sql."""
    return resources.files(__name__).joinpath(f"{name}.sql").read_text()
