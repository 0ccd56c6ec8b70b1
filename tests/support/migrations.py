"""The schema migrations as data: what a database recorded as applied, and what the release declares."""
from __future__ import annotations

import psycopg

from ledger.migrate import available_migrations


def applied_migrations(url: str) -> list[tuple[int, str, str]]:
    """(version, name, checksum) of every migration ledger.schema_migrations records, in order."""
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT version, name, checksum FROM ledger.schema_migrations ORDER BY version").fetchall()


def declared_migrations() -> list[tuple[int, str, str]]:
    """(version, name, checksum) of every migration this release ships, in order."""
    return [(m.version, m.name, m.checksum) for m in available_migrations()]
