"""Versioned, additive schema migrations.

Migrations are plain SQL files in ``ledger/migrations`` named ``NNNN_name.sql``.
Each one runs in its own transaction and is recorded in
``ledger.schema_migrations`` with a checksum, so a file edited after it was
applied is reported instead of silently ignored. A transaction-level advisory
lock serialises concurrent ``ledgerctl migrate`` runs (several replicas may
start at once). Every migration must be additive so that the previous release
keeps serving while it runs. The statements on the history are named SQL in
ledger/sql/migrations.sql.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

import psycopg

from ledger.errors import MigrationError
from ledger.queries import SQL

_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def available_migrations() -> list[Migration]:
    found = []
    for entry in resources.files("ledger.migrations").iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = _FILE_NAME.match(entry.name)
        if not match:
            raise MigrationError(f"migration file name {entry.name!r} is not NNNN_name.sql")
        found.append(Migration(int(match[1]), match[2], entry.read_text()))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"migration versions must be 1..N without gaps, got {versions}")
    return found


def applied_migrations(conn: psycopg.Connection) -> dict[int, tuple[str, str]]:
    if not conn.execute(SQL.migration_history_exists).fetchone()[0]:
        return {}
    rows = conn.execute(SQL.migration_history).fetchall()
    return {version: (name, checksum) for version, name, checksum in rows}


def migrate(dsn: str, *, upto: int | None = None) -> list[Migration]:
    """Apply every pending migration (up to version ``upto``: the schema of the release whose last
    migration it is); return those applied by this call."""
    migrations = available_migrations()
    applied_now = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for migration in migrations:
            if upto is not None and migration.version > upto:
                break
            with conn.transaction():
                conn.execute(SQL.migration_lock)
                conn.execute(SQL.migration_history_create)
                done = applied_migrations(conn)
                if migration.version in done:
                    _, checksum = done[migration.version]
                    if checksum != migration.checksum:
                        raise MigrationError(
                            f"migration {migration.version:04d}_{migration.name} was changed "
                            "after it was applied; add a new migration instead")
                    continue
                conn.execute(migration.sql)
                conn.execute(SQL.migration_record, {"version": migration.version, "name": migration.name,
                                                    "checksum": migration.checksum})
                applied_now.append(migration)
        unknown = set(applied_migrations(conn)) - {m.version for m in migrations}
        if unknown:
            raise MigrationError(
                f"database has migrations {sorted(unknown)} this release does not know; "
                "it was migrated by a newer release")
    return applied_now


def pending(dsn: str) -> list[Migration]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        done = applied_migrations(conn)
    return [m for m in available_migrations() if m.version not in done]
