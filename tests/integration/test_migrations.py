"""Schema migrations, each test on a fresh database of its own on the session's server."""
from __future__ import annotations

import psycopg
import pytest

from devkit.procs import run_together
from ledger.errors import MigrationError
from ledger.migrate import available_migrations, migrate, pending
from tests.support.migrations import applied_migrations, declared_migrations


def _tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {r[0] for r in conn.execute(
            "SELECT schemaname || '.' || tablename FROM pg_tables WHERE schemaname IN ('ledger', 'billing')")}


def test_migrate_on_an_empty_database_creates_the_schema_and_records_every_migration(fresh_db):
    applied = migrate(fresh_db)

    assert [(m.version, m.name, m.checksum) for m in applied] == declared_migrations()
    assert applied_migrations(fresh_db) == declared_migrations()
    assert {"ledger.events", "ledger.attempts", "ledger.deliveries", "ledger.schema_migrations"} <= _tables(fresh_db)
    assert pending(fresh_db) == []


def test_migrate_again_applies_nothing_and_changes_nothing(fresh_db):
    migrate(fresh_db)
    tables = _tables(fresh_db)
    recorded = applied_migrations(fresh_db)

    assert migrate(fresh_db) == []
    assert _tables(fresh_db) == tables
    assert applied_migrations(fresh_db) == recorded


def test_two_concurrent_migrations_of_a_fresh_database_both_succeed_and_apply_each_migration_once(fresh_db):
    def run(i: int):
        try:
            return migrate(fresh_db)
        except Exception as exc:  # reported by the assertion below
            return exc

    results = run_together(run, 2)

    assert not any(isinstance(r, Exception) for r in results), results
    versions_applied = sorted(m.version for r in results for m in r)
    assert versions_applied == [m.version for m in available_migrations()]  # each once, by one of the two
    assert applied_migrations(fresh_db) == declared_migrations()


def test_a_migration_changed_after_it_was_applied_raises_migration_error(fresh_db):
    migrate(fresh_db)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("UPDATE ledger.schema_migrations SET checksum = 'edited-after-release' WHERE version = 1")
    first = available_migrations()[0]

    with pytest.raises(MigrationError, match=f"{first.version:04d}_{first.name} was changed after it was applied"):
        migrate(fresh_db)


def test_a_database_migrated_by_a_newer_release_raises_migration_error(fresh_db):
    migrate(fresh_db)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO ledger.schema_migrations (version, name, checksum) VALUES (9999, 'future', 'x')")

    with pytest.raises(MigrationError, match="9999"):
        migrate(fresh_db)
