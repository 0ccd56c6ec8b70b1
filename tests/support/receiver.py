"""Helpers for the receiver tests: signed bodies, the ledger as data, the wake-up queue,
and the real receiver (gunicorn) as a subprocess."""
from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg
import redis
import stripe

from devkit.servers import free_port

VENV_BIN = Path(sys.executable).parent
# A marker put inside every generated payload: no error answer may contain it.
PAYLOAD_MARKER = "payload-marker-6b1f0c"


def sign(body: str | bytes, secret: str, timestamp: int | None = None) -> str:
    """A Stripe-Signature header built by the stripe library's own signing rules."""
    text = body.decode("utf-8") if isinstance(body, bytes) else body
    return stripe.WebhookSignature.generate_signature_header(
        text, secret, timestamp=int(time.time()) if timestamp is None else timestamp)


def new_event_id() -> str:
    return "evt_test_" + uuid.uuid4().hex


def event_dict(event_id: str | None = None, **overrides) -> dict:
    """A Stripe event envelope (as Stripe sends it) with overridable top-level fields."""
    event = {
        "id": event_id or new_event_id(),
        "object": "event",
        "api_version": "2024-06-20",
        "created": 1718000000,
        "livemode": False,
        "type": "customer.updated",
        "pending_webhooks": 1,
        "request": {"id": None, "idempotency_key": None},
        "data": {"object": {"id": "cus_test_1", "object": "customer", "description": PAYLOAD_MARKER}},
    }
    event.update(overrides)
    return event


def event_body(event_id: str | None = None, **overrides) -> str:
    """The JSON text of an event, formatted as Stripe does (indented, so the exact bytes matter)."""
    return json.dumps(event_dict(event_id, **overrides), indent=2)


# -- the ledger, read as plain data ------------------------------------------------

LEDGER_TABLES = {
    "events": "SELECT row_to_json(t)::text FROM ledger.events t ORDER BY id",
    "attempts": "SELECT row_to_json(t)::text FROM ledger.attempts t ORDER BY event_id, attempt",
    "deliveries": "SELECT row_to_json(t)::text FROM ledger.deliveries t ORDER BY event_id, delivered_at",
}


def ledger_snapshot(url: str) -> dict[str, list[str]]:
    """Every row of ledger.events, ledger.attempts and ledger.deliveries, as JSON text, in a stable order."""
    with psycopg.connect(url) as conn:
        return {table: [r[0] for r in conn.execute(sql)] for table, sql in LEDGER_TABLES.items()}


def event_row(url: str, event_id: str) -> dict | None:
    """One ledger.events row with payload as stored text and stripe_created as epoch seconds."""
    with psycopg.connect(url) as conn:
        cur = conn.execute(
            "SELECT id, type, status, (SELECT count(*) FROM ledger.deliveries d WHERE d.event_id = e.id) AS deliveries,"
            "       livemode, api_version, account, payload::text AS payload, "
            "       extract(epoch FROM stripe_created)::bigint AS created, next_attempt_at, "
            "       next_attempt_at <= now() AS due_now, wakeup_at, lease_owner "
            "  FROM ledger.events e WHERE id = %s", (event_id,))
        row = cur.fetchone()
        if row is None:
            return None
        return dict(zip([c.name for c in cur.description], row))


def execute(url: str, sql: str, params: tuple | dict = ()) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql, params)


def count_events(url: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT count(*) FROM ledger.events").fetchone()[0]


# -- the wake-up queue (Celery's redis transport keeps a queue as a Redis list) -----

def drop_queue(broker_url: str, name: str) -> None:
    """Delete a wake-up queue so no test after this one finds our messages (no-op if the broker is down)."""
    if not broker_url.startswith("redis"):
        return
    try:
        with redis.Redis.from_url(broker_url, socket_connect_timeout=1, socket_timeout=1) as client:
            client.delete(name)
    except redis.RedisError:
        pass


@dataclass
class WakeupQueue:
    redis_url: str
    name: str

    def _client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def clear(self) -> None:
        drop_queue(self.redis_url, self.name)

    def __len__(self) -> int:
        with self._client() as client:
            return client.llen(self.name)

    def messages(self) -> list[dict]:
        """Each queued message: its task name and decoded (args, kwargs)."""
        with self._client() as client:
            raw = client.lrange(self.name, 0, -1)
        out = []
        for item in raw:
            message = json.loads(item)
            args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
            out.append({"task": message["headers"]["task"], "args": args, "kwargs": kwargs})
        return out


def deliver_at_once(send, copies: int) -> list:
    """Call send(i) for i in range(copies) from that many threads released together; their results.

    An exception in a thread is re-raised here rather than lost.
    """
    start = threading.Barrier(copies)
    results: list = [None] * copies

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = send(i)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(copies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


# -- the real receiver -------------------------------------------------------------

@dataclass
class HttpAnswer:
    status_code: int
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def http_request(port: int, method: str, path: str, body: bytes | None = None,
                 headers: dict | None = None, timeout: float = 30) -> HttpAnswer:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return HttpAnswer(response.status, response.read())
    finally:
        conn.close()


class GunicornReceiver:
    """`gunicorn 'ingest.app:create_app()'` in a process group of its own."""

    def __init__(self, env: dict[str, str], *, workers: int = 2, extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.env = env
        self.workers = workers
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="receiver-", suffix=".log", delete=False)

    @property
    def command(self) -> list[str]:
        # No control socket: the default one is a fixed path in $HOME shared by every gunicorn.
        return [str(VENV_BIN / "gunicorn"), "-b", f"127.0.0.1:{self.port}", "-w", str(self.workers),
                "--no-control-socket", *self.extra_args, "ingest.app:create_app()"]

    def start(self, ready_timeout_s: float = 30) -> "GunicornReceiver":
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"receiver exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if http_request(self.port, "GET", "/healthz", timeout=2).status_code == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"receiver did not answer /healthz:\n{self.log()}")

    def post(self, body: bytes, headers: dict) -> HttpAnswer:
        return http_request(self.port, "POST", "/webhooks/stripe", body,
                            {"Content-Type": "application/json", **headers})

    def kill(self) -> None:
        """SIGKILL the whole process group: master and every worker, no cleanup."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")[-4000:]

    def close(self) -> None:
        self.kill()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


def receiver_env(database_url: str, broker_url: str, secret: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(DATABASE_URL=database_url, CELERY_BROKER_URL=broker_url, STRIPE_WEBHOOK_SECRET=secret, **extra)
    return env
