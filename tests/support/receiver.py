"""Helpers for the receiver tests: Stripe-shaped bodies, the ledger as data, the wake-up queue, and the
environment of a real receiver (devkit.stack.Receiver)."""
from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass

import psycopg
import redis

from devkit.stack import stack_env

# A marker put inside every generated payload: no error answer may contain it.
PAYLOAD_MARKER = "payload-marker-6b1f0c"


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
    """Delete a wake-up queue so no test after this one finds our messages (no-op if the broker is down).
    On RabbitMQ the queue is emptied (its declaration stays the workers')."""
    if broker_url.startswith("amqp"):
        from devkit.servers import purge_amqp_queues

        try:
            purge_amqp_queues(broker_url, [name])
        except OSError:
            pass
        return
    if not broker_url.startswith("redis"):
        return
    try:
        with redis.Redis.from_url(broker_url, socket_connect_timeout=1, socket_timeout=1) as client:
            client.delete(name)
    except redis.RedisError:
        pass


class CountingClient:
    """A receiver app's test client, and the ledger's row counts (events, deliveries, attempts) since it
    was made (``baseline``): what a fuzz test compares after every request."""

    def __init__(self, app, db_url: str):
        self.app = app
        self.client = app.test_client()
        self.conn = psycopg.connect(db_url, autocommit=True)
        self.baseline = self.counts()

    def counts(self) -> tuple[int, int, int]:
        return self.conn.execute(
            "SELECT (SELECT count(*) FROM ledger.events), (SELECT count(*) FROM ledger.deliveries), "
            "(SELECT count(*) FROM ledger.attempts)").fetchone()


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


# -- the real receiver -------------------------------------------------------------

def receiver_env(database_url: str, broker_url: str, secret: str, **extra: str) -> dict[str, str]:
    """The environment of a receiver process on this database and broker, verifying with ``secret``."""
    return stack_env(database_url, broker_url, {"STRIPE_WEBHOOK_SECRET": secret, **extra})
