"""Fixtures of every layer; nothing here starts or needs a server until a test asks for it.

* ``database_url``: a database of its own per test session, migrated once, on the session's PostgreSQL
  (tests/support/postgres.py: TEST_PG_URL or DATABASE_URL, else the machine's on 127.0.0.1:5432, else a
  private server for the session), dropped at the end. ``db`` empties every ledger/billing table before a test.
  ``fresh_db``: an empty, unmigrated database of the test's own.
* ``redis_url``: a private redis-server per session (devkit.servers.PrivateRedis), never the shared one.
* ``settings``: Settings on both, with the tests' webhook secret and quick retries.
* ``effect_endpoint``: product backends for the outbox's webhook sender (tests/support/effect_endpoint.py).

The layers add their own: tests/integration/conftest.py (in-process receivers, a private PostgreSQL to
break) and tests/e2e/conftest.py (real receiver and worker processes); tests/support/ledger_fixtures.py
has the fixtures both of those share.
"""
from __future__ import annotations

import time

import psycopg
import pytest

from devkit.servers import PrivateRedis
from ledger.config import Settings
from ledger.migrate import migrate
from tests.support import postgres
from tests.support.constants import WEBHOOK_SECRET
from tests.support.effect_endpoint import SECRET, EffectEndpoint


def pytest_terminal_summary(terminalreporter):
    if postgres.described():
        terminalreporter.write_line(f"PostgreSQL: {postgres.described()}")


def pytest_unconfigure(config):
    postgres.shutdown()


@pytest.fixture(scope="session")
def database_url():
    with postgres.scratch_database("ledger_test") as url:
        migrate(url)
        yield url


def truncate_all(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables "
            "WHERE schemaname IN ('ledger', 'billing') AND tablename <> 'schema_migrations'")]
        if not tables:
            return
        for attempt in range(1, 4):
            try:
                conn.execute("TRUNCATE " + ", ".join(tables) + " CASCADE")
                return
            except psycopg.errors.DeadlockDetected:
                # A process the previous test stopped may still be finishing its last transaction: its
                # row locks and TRUNCATE's table locks can meet in opposite orders. Postgres chose us.
                if attempt == 3:
                    raise
                time.sleep(0.2 * attempt)


@pytest.fixture
def db(database_url):
    """A clean, migrated database for this test; yields its URL."""
    truncate_all(database_url)
    return database_url


@pytest.fixture
def fresh_db():
    """An empty database (CREATE DATABASE with a unique name), dropped after the test."""
    with postgres.scratch_database("ledger_migrations") as url:
        yield url


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    server = PrivateRedis(tmp_path_factory.mktemp("redis") / "redis.log").start()
    yield server.url
    server.stop()


@pytest.fixture
def settings(db, redis_url) -> Settings:
    return Settings(database_url=db, broker_url=redis_url, webhook_secrets=(WEBHOOK_SECRET,),
                    lease_s=30, retry_base_s=0.2, retry_cap_s=2.0, sweep_overdue_s=1.0)


@pytest.fixture
def effect_endpoint():
    """Build EffectEndpoint instances (tests/support/effect_endpoint.py), started unless start=False;
    every one is closed after the test."""
    made = []

    def make(*, secret: str = SECRET, start: bool = True, **kwargs):
        endpoint = EffectEndpoint(secret, **kwargs)
        made.append(endpoint)
        return endpoint.start() if start else endpoint

    yield make
    for endpoint in made:
        endpoint.down()
