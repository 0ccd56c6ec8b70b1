"""The real stack for the acceptance specification (tests/e2e/features, tests/e2e/test_acceptance_ledger.py).

A ``Stack`` is one deployment: a gunicorn receiver, real ``celery worker`` processes
running a release of the product's handlers (tests/support/acceptance_release*.py),
Postgres (the session's test database) and the session's private Redis, on a queue of
the stack's own. Stacks differ by their retry and lease settings (``PROFILES``); a
test module starts each one it needs once and reuses it scenario after scenario,
while the ``db`` fixture empties the ledger and billing tables before each scenario.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from devkit.procs import pid_alive, wait_until
from devkit.stack import Receiver
from devkit.stripe_sim import Backoff, StripeSimulator
from ledger.config import Settings
from tests.support import acceptance_business
from tests.support.receiver import drop_queue, receiver_env
from tests.support.workers import WorkerProcess, run_ledgerctl

RELEASES = {1: ("tests.support.acceptance_release1",), 2: ("tests.support.acceptance_release2",)}

# name -> Settings overrides. Nothing else differs between stacks.
PROFILES = {
    # Our own retries come quickly: a failed attempt is retried within about a second.
    # The lease is short enough for a crash scenario to wait it out, and long enough
    # (Celery's soft time limit is half of it) for any attempt on a busy machine.
    "quick retries": dict(lease_s=10, retry_base_s=0.2, retry_cap_s=1.0, max_attempts=20),
    # Our own retries wait up to an hour: only Stripe's retry can make a failed event due now.
    "hour backoff": dict(lease_s=30, retry_base_s=3600.0, retry_cap_s=3600.0, max_attempts=8),
}
DEADLINE_S = 90.0  # for anything a worker has to do: generous, the machine is shared


@dataclasses.dataclass
class Stack:
    name: str
    settings: Settings
    secret: str
    log_dir: Path
    receiver: Receiver | None = None
    worker: WorkerProcess | None = None
    release: int = 1

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.receiver.port}/webhooks/stripe"

    def start(self) -> "Stack":
        env = receiver_env(self.settings.database_url, self.settings.broker_url, self.secret,
                           LEDGER_QUEUE=self.settings.queue_name)
        self.receiver = Receiver(env, self.log_dir, workers=2).start()
        self.deploy(self.release)
        return self

    def deploy(self, release: int) -> None:
        """Replace the workers by ones running ``release`` of the handlers (a deploy: kill, start)."""
        if self.worker is not None:
            self.worker.kill()
        self.worker = WorkerProcess(self.settings, self.log_dir, concurrency=2, label=f"acc-r{release}",
                                    handler_modules=RELEASES[release])
        self.worker.start().wait_ready(timeout_s=DEADLINE_S)
        self.release = release

    def reset(self) -> None:
        """Before a scenario: no wake-up left in the queue, every process alive.

        The release stays what it is (release 2 only adds fixes; a scenario that needs
        release 1 says so and gets it from ``ensure_release``).
        """
        drop_queue(self.settings.broker_url, self.settings.queue_name)
        if not self.receiver.alive:
            self.receiver.kill()
            self.receiver = Receiver(self.receiver.env, self.log_dir, workers=2).start()
        if not self.worker.alive:
            self.deploy(self.release)

    def ensure_release(self, release: int) -> None:
        if self.release != release:
            self.deploy(release)

    def simulator(self, url: str | None = None, **kwargs) -> StripeSimulator:
        """Stripe, pointed at this stack's receiver (or ``url``), redelivering quickly on a non-2xx."""
        kwargs.setdefault("backoff", Backoff(base_s=0.2, cap_s=2.0, max_attempts=6))
        return StripeSimulator(url=url or self.url, secret=self.secret, timeout_s=30.0, **kwargs)

    def ledgerctl(self, *args: str, **overrides) -> subprocess.CompletedProcess:
        return run_ledgerctl(dataclasses.replace(self.settings, **overrides), *args, timeout_s=DEADLINE_S)

    def logs(self) -> str:
        parts = []
        if self.receiver is not None:
            parts.append("--- receiver ---\n" + self.receiver.log(4000))
        if self.worker is not None:
            parts.append("--- worker ---\n" + self.worker.log(4000))
        return "\n".join(parts)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.kill()
        if self.receiver is not None:
            self.receiver.kill()
        drop_queue(self.settings.broker_url, self.settings.queue_name)


class Stacks:
    """Stacks by profile name, started on first use, all closed by ``close()``."""

    def __init__(self, database_url: str, broker_url: str, secret: str, log_dir: Path):
        self.database_url = database_url
        self.broker_url = broker_url
        self.secret = secret
        self.log_dir = log_dir
        self._stacks: dict[str, Stack] = {}

    def get(self, profile: str) -> Stack:
        if profile not in self._stacks:
            settings = Settings(database_url=self.database_url, broker_url=self.broker_url,
                                webhook_secrets=(self.secret,), sweep_overdue_s=0.2,
                                queue_name=f"acceptance-{profile.replace(' ', '-')}-{uuid.uuid4().hex[:8]}",
                                **PROFILES[profile])
            stack = Stack(profile, settings, self.secret, self.log_dir)
            self._stacks[profile] = stack
            stack.start()
        stack = self._stacks[profile]
        stack.reset()
        return stack

    def close(self) -> None:
        for stack in self._stacks.values():
            stack.close()
        self._stacks.clear()


# -- reading the outcome ------------------------------------------------------------------

class Ledger:
    """The test database, read as the business and the operator see it (one autocommit connection)."""

    def __init__(self, url: str):
        self.url = url
        self.conn = psycopg.connect(url, autocommit=True, row_factory=dict_row)

    def close(self) -> None:
        self.conn.close()

    def rows(self, sql: str, params=None) -> list[dict]:
        return self.conn.execute(sql, params).fetchall()

    def value(self, sql: str, params=None):
        row = self.conn.execute(sql, params).fetchone()
        return None if row is None else next(iter(row.values()))

    def execute(self, sql: str, params=None) -> None:
        self.conn.execute(sql, params)

    def reset_business(self) -> None:
        acceptance_business.reset_tables(self.conn)

    def event(self, event_id: str) -> dict | None:
        rows = self.rows("SELECT e.*, now() AS db_now, (SELECT count(*) FROM ledger.deliveries d "
                         "WHERE d.event_id = e.id) AS deliveries FROM ledger.events e WHERE id = %s", (event_id,))
        return rows[0] if rows else None

    def attempts(self, event_id: str) -> list[dict]:
        return self.rows("SELECT * FROM ledger.attempts WHERE event_id = %s ORDER BY attempt", (event_id,))

    def wait_status(self, event_id: str, *statuses: str, timeout_s: float = DEADLINE_S, logs=None) -> dict:
        def check():
            row = self.event(event_id)
            return row if row is not None and row["status"] in statuses else None
        try:
            return wait_until(check, timeout_s=timeout_s, interval_s=0.1,
                            what=f"{event_id} to reach {'/'.join(statuses)}")
        except AssertionError as exc:
            row = self.event(event_id) or {}
            raise AssertionError(f"{exc}; it is {row.get('status')} ({row.get('failure_reason')}: "
                                 f"{row.get('last_error')}), attempts {row.get('attempts')}"
                                 + (f"\n{logs()}" if logs else "")) from None

    def credits(self, invoice_id: str) -> int:
        return self.value("SELECT count(*) FROM public.acceptance_credits WHERE invoice_id = %s", (invoice_id,))

    def snapshot(self) -> dict[str, list[str]]:
        """Every business row (billing.* and the product's tables), as JSON text, in a stable order."""
        tables = [r["t"] for r in self.rows(
            "SELECT format('%I.%I', schemaname, tablename) AS t FROM pg_tables "
            "WHERE schemaname = 'billing' OR tablename LIKE 'acceptance\\_%' ORDER BY 1")]
        return {t: [r["j"] for r in self.rows(f"SELECT row_to_json(x)::text AS j FROM {t} x ORDER BY 1")]
                for t in tables if t != "public.acceptance_faults"}


def kill_pid(pid: int) -> None:
    """SIGKILL one process (no clean-up at all) and wait until it is gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    wait_until(lambda: not pid_alive(pid), timeout_s=30, what=f"process {pid} to be gone")


def sweep_until_redriven(stack: Stack, event_id: str, *, timeout_s: float = DEADLINE_S) -> dict:
    """Run ``ledgerctl sweep --json`` until a pass re-drives something (the wake-up must be overdue first)."""
    def once():
        done = stack.ledgerctl("sweep", "--json")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        return result if result["redriven"] >= 1 else None
    return wait_until(once, timeout_s=timeout_s, interval_s=0.2, what=f"a sweep pass to re-drive {event_id}")
