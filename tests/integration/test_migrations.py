"""Schema migrations, each test on a fresh database of its own on the shared server."""
from __future__ import annotations

import os
import subprocess
import threading
import uuid

import psycopg
import pytest

from ledger.errors import MigrationError
from ledger.migrate import available_migrations, migrate, pending
from tests.conftest import ADMIN_URL, _with_db
from tests.support.receiver import VENV_BIN


@pytest.fixture
def fresh_db():
    """An empty database (CREATE DATABASE with a unique name), dropped after the test."""
    name = f"ledger_migrations_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield _with_db(ADMIN_URL, name)
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _applied(url: str) -> list[tuple[int, str, str]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT version, name, checksum FROM ledger.schema_migrations ORDER BY version").fetchall()


def _tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {r[0] for r in conn.execute(
            "SELECT schemaname || '.' || tablename FROM pg_tables WHERE schemaname IN ('ledger', 'billing')")}


def _expected() -> list[tuple[int, str, str]]:
    return [(m.version, m.name, m.checksum) for m in available_migrations()]


def test_migrations_are_numbered_one_to_n_without_gaps():
    versions = [m.version for m in available_migrations()]

    assert versions == list(range(1, len(versions) + 1)) and versions


def test_migrate_on_an_empty_database_creates_the_schema_and_records_every_migration(fresh_db):
    applied = migrate(fresh_db)

    assert [(m.version, m.name, m.checksum) for m in applied] == _expected()
    assert _applied(fresh_db) == _expected()
    assert {"ledger.events", "ledger.attempts", "ledger.deliveries", "ledger.schema_migrations"} <= _tables(fresh_db)
    assert pending(fresh_db) == []


def test_migrate_again_applies_nothing_and_changes_nothing(fresh_db):
    migrate(fresh_db)
    tables = _tables(fresh_db)
    recorded = _applied(fresh_db)

    assert migrate(fresh_db) == []
    assert _tables(fresh_db) == tables
    assert _applied(fresh_db) == recorded


def test_two_concurrent_migrations_of_a_fresh_database_both_succeed_and_apply_each_migration_once(fresh_db):
    start = threading.Barrier(2)
    results: list = [None, None]

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = migrate(fresh_db)
        except Exception as exc:  # reported by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert not any(isinstance(r, Exception) for r in results), results
    versions_applied = sorted(m.version for r in results for m in r)
    assert versions_applied == [m.version for m in available_migrations()]  # each once, by one of the two
    assert _applied(fresh_db) == _expected()


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


def _ledgerctl(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DATABASE_URL": url}
    return subprocess.run([str(VENV_BIN / "ledgerctl"), *args], env=env, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def test_ledgerctl_migrate_check_exits_1_listing_what_is_pending_on_a_fresh_database(fresh_db):
    done = _ledgerctl(fresh_db, "migrate", "--check")

    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == [f"pending {m.version:04d}_{m.name}" for m in available_migrations()]


def test_ledgerctl_migrate_applies_the_schema_and_check_then_exits_0(fresh_db):
    migrated = _ledgerctl(fresh_db, "migrate")
    checked = _ledgerctl(fresh_db, "migrate", "--check")
    again = _ledgerctl(fresh_db, "migrate")

    assert migrated.returncode == 0, migrated.stderr
    assert f"schema up to date ({len(available_migrations())} applied)" in migrated.stdout
    assert _applied(fresh_db) == _expected()
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout == ""
    assert again.returncode == 0 and "schema up to date (0 applied)" in again.stdout
