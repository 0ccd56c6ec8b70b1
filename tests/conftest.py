"""Shared fixtures.

* ``database_url``: a database of its own per test session, migrated once, on the
  machine's PostgreSQL (``TEST_PG_URL``, default postgresql://postgres@127.0.0.1:5432/postgres),
  dropped at the end. ``db`` truncates every ledger/billing table before a test.
* ``private_postgres``: a server of the test's own, for tests that stop or break it.
* ``redis_url``: a private redis-server per session (pytest-redis), never the shared one.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import psycopg
import pytest
from pytest_redis import factories as redis_factories

from ledger.config import Settings
from ledger.migrate import migrate
from tests.support.pgserver import PrivatePostgres

ADMIN_URL = os.environ.get("TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
FIXTURES_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "stripe-fixtures"
WEBHOOK_SECRET = "whsec_test_primary_0123456789"

redis_proc = redis_factories.redis_proc(port=None)


def _with_db(url: str, name: str) -> str:
    return url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(scope="session")
def database_url():
    name = f"ledger_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = _with_db(ADMIN_URL, name)
    migrate(url)
    yield url
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def truncate_all(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables "
            "WHERE schemaname IN ('ledger', 'billing') AND tablename <> 'schema_migrations'")]
        if tables:
            conn.execute("TRUNCATE " + ", ".join(tables) + " CASCADE")


@pytest.fixture
def db(database_url):
    """A clean, migrated database for this test; yields its URL."""
    truncate_all(database_url)
    return database_url


@pytest.fixture(scope="session")
def redis_url(redis_proc):
    return f"redis://{redis_proc.host}:{redis_proc.port}/0"


@pytest.fixture
def settings(db, redis_url) -> Settings:
    return Settings(database_url=db, broker_url=redis_url, webhook_secrets=(WEBHOOK_SECRET,),
                    lease_s=30, retry_base_s=0.2, retry_cap_s=2.0, sweep_overdue_s=1.0)


@pytest.fixture
def private_postgres():
    server = PrivatePostgres().init()
    server.start()
    yield server
    server.destroy()


def fixture_files() -> list[Path]:
    return sorted(FIXTURES_DIR.glob("*.json")) if FIXTURES_DIR.is_dir() else []
