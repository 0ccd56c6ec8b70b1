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
from devkit.servers import PrivatePostgres

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


# --- Operator stage: ledgerctl in-process, workers with their own environment, a prepared ledger ---

@pytest.fixture
def configured_worker_factory(tmp_path):
    """Like ``worker_factory``, plus handler modules and extra environment (METRICS_PORT, ...) per worker.

    Every worker is SIGKILLed (whole process group) at teardown.
    """
    from tests.support.workers import TEST_HANDLERS

    started: list[_WorkerProcess] = []

    def start(settings: Settings, *, handler_modules: tuple[str, ...] = (TEST_HANDLERS,),
              env: dict[str, str] | None = None, concurrency: int = 1, label: str = "w",
              ready: bool = True) -> _WorkerProcess:
        worker = _WorkerProcess(settings, tmp_path, concurrency=concurrency, label=label,
                                handler_modules=handler_modules, extra_env=env)
        started.append(worker)
        worker.start()
        if ready:
            worker.wait_ready()
        return worker

    yield start
    for worker in started:
        worker.kill()


@pytest.fixture
def ledgerctl_cli(broker_settings, monkeypatch):
    """Run ``ops.cli.cli`` in-process with click's CliRunner, configured through ``CliRunner(env=...)``.

    The environment is exactly the one ``run_ledgerctl`` gives a subprocess (``env_for(broker_settings)``;
    variables that one drops are unset). ``ledgerctl_cli(*args, code=0)`` asserts the exit code, and that a
    non-zero one came from the command itself (SystemExit / click), not from an unexpected exception.
    The Postgres pools the commands open are closed at teardown (each invocation opens one).
    """
    from click.testing import CliRunner

    import ops.cli
    from tests.support.workers import env_for

    contexts = []

    class _ClosingContext(ops.cli._Context):
        def __init__(self):
            super().__init__()
            contexts.append(self)

    monkeypatch.setattr(ops.cli, "_Context", _ClosingContext)
    env = env_for(broker_settings)
    base_env = {**{k: None for k in os.environ if k not in env}, **env}

    def invoke(*args: str, code: int | None = 0, input: str | None = None, env: dict | None = None):
        runner = CliRunner(env={**base_env, **(env or {})})
        result = runner.invoke(ops.cli.cli, list(args), input=input, catch_exceptions=True)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            import traceback

            raise AssertionError(
                f"ledgerctl {' '.join(args)} raised {result.exception!r}:\n"
                + "".join(traceback.format_exception(*result.exc_info)) + result.output)
        if code is not None:
            assert result.exit_code == code, (
                f"ledgerctl {' '.join(args)} exited {result.exit_code}, expected {code}:\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
        return result

    yield invoke
    for ctx in contexts:
        if ctx._pool is not None:
            ctx._pool.close()


@_dataclasses.dataclass
class PreparedLedger:
    """What ``prepared_ledger`` built: every event's id, type and status, and the derived expectations."""
    rows: dict[str, tuple[str, str]]          # id -> (type, status)
    groups: dict[str, list[str]]              # name -> ids (see prepared_ledger)
    oldest_unprocessed_min_age_s: float

    def by_status(self) -> dict[str, int]:
        import collections

        return dict(collections.Counter(status for _, status in self.rows.values()))

    def by_status_and_type(self) -> list[dict]:
        import collections

        counts = collections.Counter((status, type_) for type_, status in self.rows.values())
        return [{"status": s, "type": t, "events": n} for (s, t), n in sorted(counts.items())]

    def ids(self, *, status: str | None = None, type_prefix: str | None = None) -> set[str]:
        return {i for i, (t, s) in self.rows.items()
                if (status is None or s == status) and (type_prefix is None or t.startswith(type_prefix))}


@pytest.fixture
def prepared_ledger(kit) -> PreparedLedger:
    """A ledger with events in every state, built through the real receiver and worker code paths.

    * ``processed``: a subscription lifecycle (customer.created, customer.subscription.*, invoice.*), 10 events;
    * ``unsupported``: 2 x invoice.upcoming (no handler) -> failed_permanent / unsupported_type;
    * ``rejected``: 1 x test.permanent -> failed_permanent / rejected_by_handler;
    * ``due_retry`` / ``scheduled_retry``: test.flaky -> failed_recoverable, next attempt 1 min ago / in 1 h;
    * ``in_progress`` / ``expired_lease``: test.effect claimed, lease ending in 1 h / 1 min ago;
    * ``received``: 2 x invoice.created never processed; ``oldest`` (the first) received 2 h ago;
    * ``old``: one processed customer.created and one unsupported invoice.upcoming received 3 days ago.

    Only timestamps are set directly (received_at, next_attempt_at, lease_expires_at); every state comes from
    the receiver's insert, the processor, or a claim.
    """
    import time as _time

    from devkit.factories import SubscriptionHistory, event
    from tests.support.workers import RecordingWaker

    now = int(_time.time())
    processor = kit.processor(waker=RecordingWaker())
    rows: dict[str, tuple[str, str]] = {}
    groups: dict[str, list[str]] = {}

    def add(group: str, evt: dict, status: str) -> str:
        kit.record(evt)
        rows[evt["id"]] = (evt["type"], status)
        groups.setdefault(group, []).append(evt["id"])
        return evt["id"]

    for evt in SubscriptionHistory().lifecycle().events:
        processor.process(add("processed", evt, "processed"))
    for n in range(2):
        processor.process(add("unsupported", event("invoice.upcoming", {"id": f"in_up_{n}", "object": "invoice"},
                                                   created=now), "failed_permanent"))
    processor.process(add("rejected", event("test.permanent", {"id": "obj_rejected"}, created=now),
                          "failed_permanent"))
    for group in ("due_retry", "scheduled_retry"):
        processor.process(add(group, event("test.flaky", {"id": f"obj_{group}", "succeed_on_attempt": 99},
                                           created=now), "failed_recoverable"))
    claims = kit.ledger("prepared-claims")
    for group in ("in_progress", "expired_lease"):
        evt_id = add(group, event("test.effect", {"id": f"obj_{group}"}, created=now), "processing")
        assert claims.claim(evt_id, worker="prepared:0", lease_s=3600) is not None
    for n in range(2):
        add("received", event("invoice.created", {"id": f"in_new_{n}", "object": "invoice"}, created=now),
            "received")
    groups["oldest"] = groups["received"][:1]
    groups["old"] = [groups["processed"][0], groups["unsupported"][0]]

    kit.execute("UPDATE ledger.events SET next_attempt_at = now() - interval '1 minute' WHERE id = ANY(%s)",
                (groups["due_retry"],))
    kit.execute("UPDATE ledger.events SET next_attempt_at = now() + interval '1 hour' WHERE id = ANY(%s)",
                (groups["scheduled_retry"],))
    kit.execute("UPDATE ledger.events SET lease_expires_at = now() - interval '1 minute' WHERE id = ANY(%s)",
                (groups["expired_lease"],))
    kit.execute("UPDATE ledger.events SET received_at = now() - interval '2 hours' WHERE id = ANY(%s)",
                (groups["oldest"],))
    kit.execute("UPDATE ledger.events SET received_at = now() - interval '3 days' WHERE id = ANY(%s)",
                (groups["old"],))

    actual = {r["id"]: (r["type"], r["status"]) for r in kit.query("SELECT id, type, status FROM ledger.events")}
    assert actual == rows, "the prepared ledger did not come out as planned"
    return PreparedLedger(rows=rows, groups=groups, oldest_unprocessed_min_age_s=7200.0)


# --- Outbox stage: a real local product backend for the webhook sender ---

@pytest.fixture
def effect_endpoint():
    """Build EffectEndpoint instances (tests/support/effect_endpoint.py), started unless start=False;
    every one is closed after the test."""
    from tests.support.effect_endpoint import SECRET, EffectEndpoint

    made = []

    def make(*, secret: str = SECRET, start: bool = True, **kwargs):
        endpoint = EffectEndpoint(secret, **kwargs)
        made.append(endpoint)
        return endpoint.start() if start else endpoint

    yield make
    for endpoint in made:
        endpoint.down()
