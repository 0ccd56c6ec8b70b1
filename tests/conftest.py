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


# -- receiver tests ------------------------------------------------------------------

@pytest.fixture
def make_receiver_app():
    """Build in-process receivers (ingest.app.create_app) from Settings; their pools are closed after the test."""
    from ingest.app import create_app
    from tests.support.receiver import drop_queue

    apps = []

    def make(app_settings: Settings):
        app = create_app(app_settings)
        apps.append(app)
        return app

    yield make
    for app in apps:
        ext = app.extensions["ledger"]
        ext.pool.close()
        celery_app = getattr(ext.waker, "_celery", None)
        if celery_app is not None:
            celery_app.close()
        # Wake-ups nobody consumes must not reach the next test (the sweep reads the queue depth).
        drop_queue(ext.settings.broker_url, ext.settings.queue_name)


@pytest.fixture
def receiver_client(settings, make_receiver_app):
    """A Flask test client of the receiver on the session database and the private Redis."""
    return make_receiver_app(settings).test_client()


@pytest.fixture
def wakeup_queue(settings):
    """The broker's list for settings.queue_name on the private Redis, emptied before the test."""
    from tests.support.receiver import WakeupQueue

    queue = WakeupQueue(settings.broker_url, settings.queue_name)
    queue.clear()
    yield queue
    queue.clear()


@pytest.fixture
def start_receiver():
    """Start the real receiver (gunicorn) as a subprocess; whatever is left is SIGKILLed after the test."""
    from tests.support.receiver import GunicornReceiver, drop_queue

    started = []

    def start(env, **kwargs):
        receiver = GunicornReceiver(env, **kwargs)
        started.append(receiver)
        return receiver.start()

    yield start
    for receiver in started:
        receiver.close()
        drop_queue(receiver.env["CELERY_BROKER_URL"], receiver.env.get("LEDGER_QUEUE") or Settings().queue_name)


# --- Worker stage: in-process kit, test-only tables, isolated broker, real worker processes ---

import dataclasses as _dataclasses
import itertools as _itertools

from tests.support.handlers_for_tests import ensure_test_tables as _ensure_test_tables
from tests.support.workers import LedgerKit as _LedgerKit
from tests.support.workers import WorkerProcess as _WorkerProcess

# Redis databases other than 0 (the default) are handed out in turn to tests that run real workers.
_broker_dbs = _itertools.count(1)


@pytest.fixture
def effects_table(db):
    """public.test_effects / public.test_locks exist and are empty (the db fixture does not touch them)."""
    with psycopg.connect(db, autocommit=True) as conn:
        _ensure_test_tables(conn)
    return db


@pytest.fixture
def kit(settings, effects_table):
    """A LedgerKit on this test's clean database; closes its pools at teardown."""
    k = _LedgerKit(settings)
    yield k
    k.close()


@pytest.fixture
def broker_settings(settings, redis_url):
    """settings with a redis database and a queue of this test's own, flushed before and after."""
    import redis

    base = redis_url.rsplit("/", 1)[0]
    with redis.Redis.from_url(redis_url) as probe:
        databases = int(probe.config_get("databases")["databases"])
    number = 1 + next(_broker_dbs) % (databases - 1) if databases > 1 else 0
    url = f"{base}/{number}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield _dataclasses.replace(settings, broker_url=url, queue_name=f"q-{uuid.uuid4().hex[:10]}")
    client.flushdb()
    client.close()


@pytest.fixture
def worker_factory(tmp_path):
    """Start real ``celery worker`` processes; every one is SIGKILLed (whole group) at teardown."""
    started: list[_WorkerProcess] = []

    def start(settings: Settings, *, concurrency: int = 1, label: str = "w", ready: bool = True) -> _WorkerProcess:
        worker = _WorkerProcess(settings, tmp_path, concurrency=concurrency, label=label)
        started.append(worker)
        worker.start()
        if ready:
            worker.wait_ready()
        return worker

    yield start
    for worker in started:
        worker.kill()
