"""receiver-cost's floor: the receiver's I/O alone, run like it, with no framework, logging, metrics or pool."""

import hmac
import json
import os
import threading
import time

import psycopg
import redis

from devkit.benchmarks.workload import WakeupMessage
from ledger.queries import SQL
from ledger.stripe_events import object_and_customer

_FIXED = {("GET", "/readyz"): ("200 OK", b'{"ready":true}')}  # any other route but the endpoint: 404


def create_app(env=os.environ):
    secret, tolerance = env["STRIPE_WEBHOOK_SECRET"].split(",")[0].encode(), int(env["STRIPE_SIGNATURE_TOLERANCE_S"])
    queue, messages = env.get("LEDGER_QUEUE", "ledger-events"), WakeupMessage(json.loads(env["BENCH_WAKEUP_TEMPLATE"]))
    local = threading.local()

    def handle(environ) -> tuple[str, bytes]:
        if (route := (environ["REQUEST_METHOD"], environ["PATH_INFO"])) != ("POST", "/webhooks/stripe"):
            return _FIXED.get(route, ("404 Not Found", b'{"outcome":"rejected"}'))
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        parts = dict(item.split("=", 1) for item in environ.get("HTTP_STRIPE_SIGNATURE", "").split(",") if "=" in item)
        t = parts.get("t", "")
        if not (t.isdigit() and abs(time.time() - int(t)) <= tolerance and hmac.compare_digest(
                hmac.new(secret, t.encode() + b"." + body, "sha256").hexdigest(), parts.get("v1", ""))):
            return "400 Bad Request", b'{"outcome":"invalid_signature"}'
        if getattr(local, "pid", None) != os.getpid():  # made in the worker process, never inherited
            local.pg = psycopg.connect(env["DATABASE_URL"], autocommit=True)
            local.redis, local.pid = redis.Redis.from_url(env["CELERY_BROKER_URL"]), os.getpid()
        event = json.loads(body)
        params = {"id": event["id"], "type": event["type"], "created": event["created"],
                  "livemode": event.get("livemode") is True, "api_version": event.get("api_version"),
                  "account": event.get("account"), "payload": body.decode(), "source": "webhook",
                  **dict(zip(("object_id", "customer_id"), object_and_customer(event["data"]["object"])))}
        if inserted := bool((local.pg.execute(SQL.event_record_delivery, params).fetchone() or (False,))[0]):
            local.redis.lpush(queue, messages.for_event(event["id"]))
        outcome = "received" if inserted else "duplicate"
        return "200 OK", json.dumps({"event_id": event["id"], "outcome": outcome}).encode()

    def app(environ, start_response):
        status, body = handle(environ)
        start_response(status, [("Content-Type", "application/json")])
        return [body]
    return app
