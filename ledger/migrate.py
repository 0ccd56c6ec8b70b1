"""Versioned, additive schema migrations.

Migrations are plain SQL files in ``ledger/migrations`` named ``NNNN_name.sql``.
Each one runs in its own transaction and is recorded in
``ledger.schema_migrations`` with a checksum, so a file edited after it was
applied is reported instead of silently ignored. A session advisory lock,
taken by polling (ledger/sql/migrations.sql), serialises concurrent
``ledgerctl migrate`` runs (several replicas may start at once). Every
migration must be additive so that the previous release keeps serving while
it runs. The statements on the history are named SQL in
ledger/sql/migrations.sql.

A migration whose first line is ``-- migrate: outside a transaction`` holds
only ``CREATE INDEX CONCURRENTLY`` statements, and ``DROP INDEX CONCURRENTLY``
of an index one of them replaces (ledger/index_builds.py): an index built
inside a transaction would hold the receiver's inserts for as long as the
build takes on a large ledger. Such a migration is recorded once every
index is built and valid; one interrupted is run again whole, and finds what
it left (an INVALID index) and builds it again.
"""
from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from importlib import resources
from typing import Callable

import psycopg

from ledger import index_builds
from ledger.errors import MigrationError
from ledger.queries import SQL

_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
OUTSIDE_A_TRANSACTION = "-- migrate: outside a transaction"
# How often a `ledgerctl migrate` waiting for another one asks again for the lock. It polls
# (pg_try_advisory_lock) rather than waits in a statement: a session waiting inside one keeps a
# snapshot, which a concurrent index build of the other's would wait for in turn.
LOCK_POLL_S = 0.2

Say = Callable[[str], None]


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def in_transaction(self) -> bool:
        return not self.sql.startswith(OUTSIDE_A_TRANSACTION)


def available_migrations() -> list[Migration]:
    found = []
    for entry in resources.files("ledger.migrations").iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = _FILE_NAME.match(entry.name)
        if not match:
            raise MigrationError(f"migration file name {entry.name!r} is not NNNN_name.sql")
        migration = Migration(int(match[1]), match[2], entry.read_text())
        if not migration.in_transaction:
            index_builds.parse(migration.sql)  # a file of anything else is refused before any is run
        found.append(migration)
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


def migrate(dsn: str, *, upto: int | None = None, say: Say | None = None) -> list[Migration]:
    """Apply every pending migration (up to version ``upto``: the schema of the release whose last
    migration it is); return those applied by this call. ``say`` hears what a long step is doing."""
    migrations = available_migrations()
    applied_now = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        _lock(conn)
        try:
            conn.execute(SQL.migration_history_create)
            for migration in migrations:
                if upto is not None and migration.version > upto:
                    break
                done = applied_migrations(conn)
                if migration.version in done:
                    _, checksum = done[migration.version]
                    if checksum != migration.checksum:
                        raise MigrationError(
                            f"migration {migration.version:04d}_{migration.name} was changed "
                            "after it was applied; add a new migration instead")
                    continue
                if migration.in_transaction:
                    with conn.transaction():
                        conn.execute(migration.sql)
                        _record(conn, migration)
                else:
                    for step in index_builds.parse(migration.sql):
                        index_builds.run(conn, step, say or (lambda _: None))
                    _record(conn, migration)
                applied_now.append(migration)
            unknown = set(applied_migrations(conn)) - {m.version for m in migrations}
            if unknown:
                raise MigrationError(
                    f"database has migrations {sorted(unknown)} this release does not know; "
                    "it was migrated by a newer release")
        finally:
            if not conn.closed and not conn.broken:
                conn.execute(SQL.migration_unlock)
    return applied_now


def _lock(conn: psycopg.Connection) -> None:
    while not conn.execute(SQL.migration_lock).fetchone()[0]:
        time.sleep(LOCK_POLL_S)


def _record(conn: psycopg.Connection, migration: Migration) -> None:
    conn.execute(SQL.migration_record, {"version": migration.version, "name": migration.name,
                                        "checksum": migration.checksum})


def pending(dsn: str) -> list[Migration]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        done = applied_migrations(conn)
    return [m for m in available_migrations() if m.version not in done]
