"""Real Celery worker processes configured from Settings, ``ledgerctl`` as a subprocess, and in-process
access to the test database (``LedgerKit``).

The processes are devkit.stack's (a process group each, a log file); ``env_for`` is the environment
that makes a child's ``Settings.from_env()`` equal to the test's ``Settings``. The e2e fixtures
(tests/e2e/conftest.py) kill every worker they started at teardown.
"""
from __future__ import annotations

import json
import subprocess
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Mapping

from devkit.procs import REPO, venv_tool, wait_until
from devkit.stack import Worker, stack_env
from ledger.config import Settings
from workers.app import effects_queue

TEST_HANDLERS = "tests.support.handlers_for_tests"


def env_for(settings: Settings, *, handler_modules: tuple[str, ...] = (TEST_HANDLERS,),
            extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment that makes ``Settings.from_env()`` in a child equal to ``settings``."""
    variables = {
        "LEDGER_QUEUE": settings.queue_name,
        "LEDGER_HANDLER_MODULES": ",".join(handler_modules),
        "LEDGER_LEASE_S": str(settings.lease_s),
        "LEDGER_MAX_ATTEMPTS": str(settings.max_attempts),
        "LEDGER_RETRY_BASE_S": str(settings.retry_base_s),
        "LEDGER_RETRY_CAP_S": str(settings.retry_cap_s),
        "LEDGER_SWEEP_OVERDUE_S": str(settings.sweep_overdue_s),
        "LEDGER_SWEEP_BATCH": str(settings.sweep_batch),
        "LEDGER_SWEEP_INTERVAL_S": str(settings.sweep_interval_s),
        "LEDGER_DEAD_PEER_S": str(settings.dead_peer_s),
        "LEDGER_RESCUE_INTERVAL_S": str(settings.rescue_interval_s),
    }
    if settings.outbox_webhook_url:
        # The outbox's webhook sender (only when the test configures one).
        variables.update({"OUTBOX_WEBHOOK_URL": settings.outbox_webhook_url,
                          "OUTBOX_WEBHOOK_SECRET": settings.outbox_webhook_secret or "",
                          "OUTBOX_TIMEOUT_S": str(settings.outbox_timeout_s)})
    variables.update(extra or {})
    return stack_env(settings.database_url, settings.broker_url, variables)


class WorkerProcess(Worker):
    """``celery -A workers worker`` on ``settings.queue_name`` and its effects queue, configured by ``env_for``."""

    def __init__(self, settings: Settings, log_dir: Path, *, concurrency: int = 1, label: str = "w",
                 handler_modules: tuple[str, ...] = (TEST_HANDLERS,), extra_env: Mapping[str, str] | None = None):
        self.settings = settings
        super().__init__(env_for(settings, handler_modules=handler_modules, extra=extra_env), log_dir,
                         queues=(settings.queue_name, effects_queue(settings.queue_name)),
                         concurrency=concurrency, node=f"{label}-{uuid.uuid4().hex[:8]}")


def run_ledgerctl(settings: Settings, *args: str, timeout_s: float = 60,
                  extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """The installed ``ledgerctl`` script, configured by ``env_for(settings)`` (plus ``extra_env``)."""
    return subprocess.run([venv_tool("ledgerctl"), *args], cwd=REPO, env=env_for(settings, extra=extra_env),
                          capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


class LedgerKit:
    """In-process access to one test database: pools, ledgers, processors, recording, inspection.

    Every pool it opens is closed by ``close()`` (the ``kit`` fixture calls it).
    """

    def __init__(self, settings: Settings):
        from ledger.db import ProcessPool

        self.settings = settings
        self._ProcessPool = ProcessPool
        self._pools: dict = {}

    def pool(self, name: str = "test", settings: Settings | None = None):
        """One pool per (name, settings): callers that need connections of their own use distinct names."""
        settings = settings or self.settings
        key = (name, settings)
        if key not in self._pools:
            self._pools[key] = self._ProcessPool(settings, name=name)
        return self._pools[key]

    def ledger(self, name: str = "test"):
        from ledger.attempts import WorkerLedger

        return WorkerLedger(self.pool(name))

    def store(self):
        from ledger.deliveries import EventStore

        return EventStore(self.pool("receiver"))

    def processor(self, settings: Settings | None = None, *, waker=None, modules: tuple[str, ...] = (TEST_HANDLERS,),
                  name: str = "test"):
        """An EventProcessor on the pool ``name``; ``modules`` are the handler modules to load."""
        import dataclasses

        from ledger.attempts import WorkerLedger
        from workers.processor import EventProcessor
        from workers.registry import load_handlers

        settings = dataclasses.replace(settings or self.settings, handler_modules=modules)
        return EventProcessor.from_settings(settings, WorkerLedger(self.pool(name, settings)),
                                            load_handlers(settings), waker)

    def record(self, evt: dict) -> str:
        from devkit.factories import incoming

        self.store().record_delivery(incoming(evt))
        return evt["id"]

    def record_many(self, evts) -> list[str]:
        from devkit.factories import incoming

        store = self.store()
        for evt in evts:
            store.record_delivery(incoming(evt))
        return [e["id"] for e in evts]

    # -- inspection -------------------------------------------------------------------------
    def connect(self):
        """A new autocommit connection of the caller's own (close it)."""
        import psycopg

        return psycopg.connect(self.settings.database_url, autocommit=True)

    def _conn(self):
        if getattr(self, "_shared", None) is None:
            self._shared = self.connect()
            self._shared_lock = threading.Lock()
        return self._shared

    def query(self, sql: str, params=None) -> list[dict]:
        from psycopg.rows import dict_row

        conn = self._conn()
        with self._shared_lock:
            return conn.cursor(row_factory=dict_row).execute(sql, params).fetchall()

    def execute(self, sql: str, params=None) -> None:
        conn = self._conn()
        with self._shared_lock:
            conn.execute(sql, params)

    def wipe(self) -> None:
        """Empty every ledger and billing table (DELETE: much faster than TRUNCATE on a few rows)."""
        tables = [r["t"] for r in self.query(
            "SELECT format('%I.%I', schemaname, tablename) AS t FROM pg_tables "
            "WHERE schemaname IN ('ledger', 'billing') AND tablename <> 'schema_migrations'")]
        self.execute("; ".join(f"DELETE FROM {t}" for t in tables))

    def event(self, event_id: str) -> dict:
        rows = self.query("SELECT *, now() AS db_now FROM ledger.events WHERE id = %s", (event_id,))
        assert rows, f"no ledger row for {event_id}"
        return rows[0]

    def status(self, event_id: str) -> str:
        return self.event(event_id)["status"]

    def attempts(self, event_id: str) -> list[dict]:
        return self.query("SELECT * FROM ledger.attempts WHERE event_id = %s ORDER BY attempt", (event_id,))

    def effects(self, event_id: str | None = None) -> int:
        if event_id is None:
            return self.query("SELECT count(*) AS n FROM public.test_effects")[0]["n"]
        return self.query("SELECT count(*) AS n FROM public.test_effects WHERE event_id = %s",
                          (event_id,))[0]["n"]

    def deliveries(self, event_id: str) -> int:
        return self.query("SELECT count(*) AS n FROM ledger.deliveries WHERE event_id = %s", (event_id,))[0]["n"]

    def billing_counts(self) -> dict[str, int]:
        tables = ("customers", "subscriptions", "invoices", "checkout_sessions", "entitlements",
                  "entitlement_summaries", "subscription_transitions", "objects")
        return {t: self.query(f"SELECT count(*) AS n FROM billing.{t}")[0]["n"] for t in tables}

    def wait_status(self, event_id: str, *statuses: str, timeout_s: float = 30.0) -> dict:
        def check():
            row = self.event(event_id)
            return row if row["status"] in statuses else None
        return wait_until(check, timeout_s=timeout_s, interval_s=0.05,
                          what=f"{event_id} to reach {'/'.join(statuses)} (now {self.status(event_id)})")

    def close(self) -> None:
        for pool in self._pools.values():
            try:
                pool.close()
            except Exception:
                pass
        self._pools.clear()
        if getattr(self, "_shared", None) is not None:
            self._shared.close()
            self._shared = None


class RecordingWaker:
    """A Waker stand-in that remembers what it was asked to wake (no broker)."""

    def __init__(self):
        self.woken: list[tuple[str, float | None]] = []

    def wake(self, event_id: str, *, countdown_s: float | None = None) -> bool:
        self.woken.append((event_id, countdown_s))
        return True

    @property
    def ids(self) -> list[str]:
        return [event_id for event_id, _ in self.woken]


def json_lines(text: str) -> list[dict]:
    """The JSON log lines of a process's output (receiver, worker, sweep), in order; other lines skipped."""
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                pass
    return lines


def claim_one(ledger, event_id: str, *, worker: str, lease_s: int):
    """The claim of one event by ``ledger`` (a WorkerLedger), or None when it is not claimable."""
    claims = ledger.claim([event_id], worker=worker, lease_s=lease_s)
    return claims[0] if claims else None


@contextmanager
def applying_one(ledger, claim):
    """One claim applied alone, as a worker applies it: its connection inside the apply transaction's
    member (fence before the body, finish after it, COMMIT at the end)."""
    with ledger.applying() as tx, tx.member(claim) as conn:
        yield conn
