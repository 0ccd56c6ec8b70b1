"""Real Celery worker processes for tests, and small helpers to wait on outcomes.

Each worker runs in a process group of its own (``start_new_session``) so the
test can kill it, prefork children included, with one ``killpg``; the
``worker_factory`` fixture (tests/conftest.py) always does at teardown.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Mapping, TypeVar

from ledger.config import Settings
from workers.app import effects_queue

REPO = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))
LEDGERCTL = str(Path(sys.executable).with_name("ledgerctl"))
TEST_HANDLERS = "tests.support.handlers_for_tests"

T = TypeVar("T")

# Variables a worker reads; anything the caller's environment sets for them is replaced.
_OWNED = ("DATABASE_URL", "CELERY_BROKER_URL", "LEDGER_", "DB_", "BROKER_", "STRIPE_", "LOG_LEVEL")


def wait_for(check: Callable[[], T], *, timeout_s: float = 30.0, interval_s: float = 0.05,
             what: str = "condition") -> T:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def run_threads(target: Callable[..., None], args: list[tuple], *, timeout_s: float = 120) -> None:
    """Start one thread per argument tuple, at once, and wait for all of them."""
    threads = [threading.Thread(target=target, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)


def env_for(settings: Settings, *, handler_modules: tuple[str, ...] = (TEST_HANDLERS,),
            extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment that makes ``Settings.from_env()`` in a child equal to ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_OWNED)}
    env.update({
        "DATABASE_URL": settings.database_url,
        "CELERY_BROKER_URL": settings.broker_url,
        "LEDGER_QUEUE": settings.queue_name,
        "LEDGER_HANDLER_MODULES": ",".join(handler_modules),
        "LEDGER_LEASE_S": str(settings.lease_s),
        "LEDGER_MAX_ATTEMPTS": str(settings.max_attempts),
        "LEDGER_RETRY_BASE_S": str(settings.retry_base_s),
        "LEDGER_RETRY_CAP_S": str(settings.retry_cap_s),
        "LEDGER_SWEEP_OVERDUE_S": str(settings.sweep_overdue_s),
        "LEDGER_SWEEP_BATCH": str(settings.sweep_batch),
        "LOG_LEVEL": "INFO",
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
    })
    if settings.outbox_webhook_url:
        # The outbox's webhook sender (only when the test configures one).
        env.update({"OUTBOX_WEBHOOK_URL": settings.outbox_webhook_url,
                    "OUTBOX_WEBHOOK_SECRET": settings.outbox_webhook_secret or "",
                    "OUTBOX_TIMEOUT_S": str(settings.outbox_timeout_s)})
    env.update(extra or {})
    return env


class WorkerProcess:
    """``celery -A workers worker`` on ``settings.queue_name``, in its own process group."""

    def __init__(self, settings: Settings, log_dir: Path, *, concurrency: int = 1, label: str = "w",
                 handler_modules: tuple[str, ...] = (TEST_HANDLERS,), extra_env: Mapping[str, str] | None = None):
        self.settings = settings
        self.concurrency = concurrency
        self.handler_modules = handler_modules
        self.extra_env = dict(extra_env or {})
        self.node = f"{label}-{uuid.uuid4().hex[:8]}"
        self.log_path = Path(log_dir) / f"{self.node}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "WorkerProcess":
        cmd = [CELERY, "-A", "workers", "worker", "--pool=prefork", "-c", str(self.concurrency),
               "--loglevel=INFO", "-Q", f"{self.settings.queue_name},{effects_queue(self.settings.queue_name)}",
               "-n", f"{self.node}@%h",
               "--without-mingle", "--without-gossip", "--without-heartbeat"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log,
                                         env=env_for(self.settings, handler_modules=self.handler_modules,
                                                     extra=self.extra_env),
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout_s: float = 60.0) -> "WorkerProcess":
        def ready():
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"worker {self.node} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            return " ready." in self.log()
        wait_for(ready, timeout_s=timeout_s, interval_s=0.1, what=f"worker {self.node} to be ready")
        return self

    def children(self) -> list[int]:
        """Pids of the prefork pool's child processes."""
        if self.proc is None:
            return []
        try:
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (parent and prefork children) and reap the parent."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # Reparented children may linger as zombies until init reaps them: dead is dead.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(pid) for pid in _group_members(self.proc.pid)):
            time.sleep(0.05)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def _alive(pid: int) -> bool:
    """True unless the process is gone or a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def pid_alive(pid: int) -> bool:
    return _alive(pid)


def run_ledgerctl(settings: Settings, *args: str, timeout_s: float = 60,
                  extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([LEDGERCTL, *args], cwd=REPO, env=env_for(settings, extra=extra_env), capture_output=True,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


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
        from ledger.store import WorkerLedger

        return WorkerLedger(self.pool(name))

    def store(self):
        from ledger.store import EventStore

        return EventStore(self.pool("receiver"))

    def processor(self, settings: Settings | None = None, *, waker=None, modules: tuple[str, ...] = (TEST_HANDLERS,),
                  name: str = "test"):
        """An EventProcessor on the pool ``name``; ``modules`` are the handler modules to load."""
        import dataclasses

        from ledger.store import WorkerLedger
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
                  "entitlement_summaries", "subscription_transitions")
        return {t: self.query(f"SELECT count(*) AS n FROM billing.{t}")[0]["n"] for t in tables}

    def wait_status(self, event_id: str, *statuses: str, timeout_s: float = 30.0) -> dict:
        def check():
            row = self.event(event_id)
            return row if row["status"] in statuses else None
        return wait_for(check, timeout_s=timeout_s, interval_s=0.05,
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
