"""The receiver's floor for ``ops/bench receiver-cost``: a bare WSGI app doing the receiver's I/O.

Per ``POST /webhooks/stripe``, what the receiver must do and nothing else: read the body,
check its ``Stripe-Signature`` (HMAC-SHA256 of ``t.body`` under the secret, the timestamp
within the tolerance), parse it as JSON, record it with the receiver's own statement
(``event_record_delivery`` from ``ledger/sql/events.sql``, the parameters
``EventStore.record_delivery`` sends, on an autocommit connection: committed before the
answer) and, for a new event, push one wake-up to Redis (one LPUSH of the message
``Waker.wake`` publishes, with the event's id), then answer 200 with a small JSON body.
No framework, no logging, no metrics, no connection pool: one connection to Postgres and
one to Redis per thread. ``GET /readyz`` answers 200.

Run under the receiver's own server and settings (``gunicorn ...
'devkit.benchmarks.minimal_wsgi:create_app()'``), from the environment the receiver gets:
``DATABASE_URL``, ``CELERY_BROKER_URL`` (a redis:// URL), ``STRIPE_WEBHOOK_SECRET``,
``STRIPE_SIGNATURE_TOLERANCE_S``, ``LEDGER_QUEUE``, plus ``BENCH_WAKEUP_TEMPLATE`` (the
wake-up message as JSON, ``workload.wakeup_template``).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time

import psycopg
import redis

from ledger.queries import SQL
from ledger.stripe_events import object_and_customer

from .workload import WakeupMessage

_OK = [("Content-Type", "application/json")]


class MinimalReceiver:
    def __init__(self, env=os.environ):
        self.database_url = env["DATABASE_URL"]
        self.broker_url = env["CELERY_BROKER_URL"]
        self.secret = env["STRIPE_WEBHOOK_SECRET"].split(",")[0].encode()
        self.tolerance_s = int(env.get("STRIPE_SIGNATURE_TOLERANCE_S", "300"))
        self.queue = env.get("LEDGER_QUEUE", "ledger-events")
        self.messages = WakeupMessage(json.loads(env["BENCH_WAKEUP_TEMPLATE"]))
        self._local = threading.local()

    def _connections(self) -> tuple[psycopg.Connection, redis.Redis]:
        local = self._local
        if getattr(local, "pid", None) != os.getpid():  # made in the worker process, never inherited
            local.pg = psycopg.connect(self.database_url, autocommit=True)
            local.redis = redis.Redis.from_url(self.broker_url)
            local.pid = os.getpid()
        return local.pg, local.redis

    def _verified(self, body: bytes, header: str) -> bool:
        parts = dict(item.split("=", 1) for item in header.split(",") if "=" in item)
        timestamp, expected = parts.get("t", ""), parts.get("v1", "")
        if not timestamp.isdigit() or abs(time.time() - int(timestamp)) > self.tolerance_s:
            return False
        signed = hmac.new(self.secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
        return hmac.compare_digest(signed, expected)

    def __call__(self, environ, start_response):
        if environ["REQUEST_METHOD"] == "GET" and environ["PATH_INFO"] == "/readyz":
            start_response("200 OK", _OK)
            return [b'{"ready":true}']
        if environ["REQUEST_METHOD"] != "POST" or environ["PATH_INFO"] != "/webhooks/stripe":
            start_response("404 Not Found", _OK)
            return [b'{"outcome":"rejected"}']
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        if not self._verified(body, environ.get("HTTP_STRIPE_SIGNATURE", "")):
            start_response("400 Bad Request", _OK)
            return [b'{"outcome":"invalid_signature"}']
        event = json.loads(body)
        conn, broker = self._connections()
        params = {"id": event["id"], "type": event["type"], "created": event["created"],
                  "livemode": event.get("livemode") is True, "api_version": event.get("api_version"),
                  "account": event.get("account"), "payload": body.decode(), "source": "webhook",
                  **dict(zip(("object_id", "customer_id"), object_and_customer(event["data"]["object"])))}
        row = conn.execute(SQL.event_record_delivery, params).fetchone()
        inserted = bool(row and row[0])
        if inserted:
            broker.lpush(self.queue, self.messages.for_event(event["id"]))
        start_response("200 OK", _OK)
        return [json.dumps({"event_id": event["id"], "outcome": "received" if inserted else "duplicate"}).encode()]


def create_app() -> MinimalReceiver:
    return MinimalReceiver()
