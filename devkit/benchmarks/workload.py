"""Workloads: backlogs of received events (loaded as the receiver would leave them, their wake-ups queued
before any worker starts: a drain measures the workers alone), the ingest's pgbench scripts, the history."""
from __future__ import annotations

import base64
import json
import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import redis

from devkit.sql import SQL
from ledger.config import Settings
from ledger.queries import SQL as LEDGER_SQL
from ledger.stripe_events import object_and_customer
from workers.app import make_celery
from workers.wakeup import Waker

from .payloads import body
from .pg import pgbench_sql

_ID = re.compile(r"\b(evt_bench|evt|cus|sub|in|si|price|prod)_([0-9a-f]{24})\b")


def _retag(text: str, tag: str) -> str:
    return _ID.sub(lambda m: f"{m[1]}_{tag}{m[2][len(tag):]}", text)


@dataclass(frozen=True)
class BacklogEvent:
    """What the receiver records of an event (ledger.deliveries.IncomingEvent)."""
    id: str
    type: str
    created: int
    livemode: bool
    api_version: str | None
    account: str | None
    body: str


class EventSource:
    """Lifecycle events generated once, re-issued per backlog (and per pass) with every id re-tagged."""

    def __init__(self, events: list[dict[str, Any]]):
        self.events = events
        self.bodies = [body(e) for e in events]
        self._issued = 0

    def backlog(self, count: int) -> list[BacklogEvent]:
        out = []
        for i in range(count):
            k = i % len(self.events)
            if k == 0:  # a new tag per pass over the events
                self._issued += 1
                tag = f"{self._issued:04x}"
            evt = self.events[k]
            out.append(BacklogEvent(id=_retag(evt["id"], tag), type=evt["type"], created=evt["created"],
                                    livemode=evt["livemode"], api_version=evt.get("api_version"),
                                    account=evt.get("account"), body=_retag(self.bodies[k], tag)))
        return out


def load_received(url: str, events: list[BacklogEvent], *, status_sql: str | None = None) -> None:
    """COPY the events in as ``received`` (plus a delivery row each), as the receiver would leave them."""
    with psycopg.connect(url, autocommit=True) as conn:
        with conn.transaction():
            with conn.cursor().copy(SQL.bench_backlog_copy_events) as copy:
                for e in events:
                    copy.write_row((e.id, e.type, datetime.fromtimestamp(e.created, tz=timezone.utc), e.livemode,
                                    e.api_version, e.account, e.body))
            with conn.cursor().copy(SQL.bench_backlog_copy_deliveries) as copy:
                for e in events:
                    copy.write_row((e.id, datetime.fromtimestamp(e.created, tz=timezone.utc)))
            if status_sql:
                conn.execute(status_sql, {"ids": [e.id for e in events]})
        conn.execute(SQL.bench_analyze_events)


def wakeup_template(broker_url: str, queue: str) -> dict[str, Any]:
    """What ``Waker.wake`` publishes for ``queue``: published to a queue of its own (no worker takes it), read back."""
    with redis.Redis.from_url(broker_url) as client:
        probe_queue = f"{queue}.template-{uuid.uuid4().hex[:8]}"
        app = make_celery(Settings(broker_url=broker_url, queue_name=probe_queue), publisher_only=True)
        if not Waker(app).wake(f"evt_probe_{uuid.uuid4().hex}"):
            raise RuntimeError("could not publish a wake-up to the private Redis")
        app.close()
        template = json.loads(client.rpop(probe_queue))
        client.delete(probe_queue)
    template["properties"]["delivery_info"] = {**template["properties"]["delivery_info"], "routing_key": queue}
    return template


class WakeupMessage:
    """Wake-up messages for any event id from ``wakeup_template``'s: the id and message ids replaced."""

    def __init__(self, template: dict[str, Any]):
        self.template = template
        _, self.kwargs, self.embed = json.loads(base64.b64decode(template["body"]))

    def for_event(self, event_id: str) -> str:
        template, task_id = self.template, str(uuid.uuid4())
        body_ = base64.b64encode(json.dumps([[event_id], self.kwargs, self.embed]).encode()).decode()
        return json.dumps({**template, "body": body_,
                           "headers": {**template["headers"], "id": task_id, "root_id": task_id,
                                       "argsrepr": repr([event_id])},
                           "properties": {**template["properties"], "correlation_id": task_id,
                                          "delivery_tag": str(uuid.uuid4())}})


def push_wakeups(broker_url: str, queue: str, event_ids: list[str]) -> None:
    """One wake-up per id, byte for byte what ``Waker.wake`` publishes, pipelined (20,000 one by one take long)."""
    if not event_ids:
        return
    messages = WakeupMessage(wakeup_template(broker_url, queue))
    with redis.Redis.from_url(broker_url) as client:
        pipe = client.pipeline(transaction=False)
        for index, event_id in enumerate(event_ids, start=1):
            pipe.lpush(queue, messages.for_event(event_id))
            if index % 2000 == 0:
                pipe.execute()
        pipe.execute()


def ingest_scripts(work_dir: Path, deliveries_sample: list) -> tuple[list[Path], dict[str, str]]:
    """The receiver's event_record_delivery of each sampled payload (the id from a random number), per transaction."""
    scripts, defines = [], {}
    for k, delivery in enumerate(deliveries_sample):
        evt = json.loads(delivery.body)
        defines.update({f"type{k}": evt["type"], f"created{k}": str(evt["created"]),
                        f"livemode{k}": "true" if evt.get("livemode") else "false", f"payload{k}": delivery.body})
        names = {"id": "('evt_pgb_' || :r)", "type": f":type{k}", "created": f":created{k}::double precision",
                 "livemode": f":livemode{k}::boolean", "payload": f":payload{k}", "source": "'webhook'::text"}
        # pgbench cannot define an empty variable: absent values are NULL literals (psycopg sends NULL too).
        values = dict(evt, **dict(zip(("object_id", "customer_id"), object_and_customer(evt["data"]["object"]))))
        for name, key in (("api_version", "api"), ("account", "account"), ("object_id", "object"),
                          ("customer_id", "customer")):
            if values.get(name):
                defines[f"{key}{k}"] = values[name]
            names[name] = f":{key}{k}::text" if values.get(name) else "NULL::text"
        path = work_dir / f"ingest-{k}.sql"
        path.write_text("\\set r random(1, 1000000000000000)\n"
                        + pgbench_sql(LEDGER_SQL.event_record_delivery, var=lambda p: names[p]) + "\n")
        scripts.append(path)
    return scripts, defines


# A lifecycle of ten events, as the factories build it.
HISTORY_TYPES = ["customer.created", "customer.subscription.created", "customer.subscription.updated",
                 "invoice.paid", "invoice.payment_failed", "customer.subscription.updated", "invoice.paid",
                 "customer.subscription.updated", "customer.subscription.updated", "customer.subscription.deleted"]


def history_sql(total: int, payload_template: str, *, days: float = 400.0,
                step_s: float = 30.0) -> tuple[list[str], list[str], dict[str, Any]]:
    """Two lists of set-based statements of about equal cost (to run at once) writing ``total`` processed events
    and their lifecycles' rows, and their parameters; ``payload_template`` holds ``__EVT__`` and ``__CUS__``."""
    head, rest = payload_template.split("__EVT__", 1)
    middle, tail = rest.split("__CUS__", 1)
    params = {"total": total, "lifecycles": total // 10, "types": HISTORY_TYPES,
              "start": datetime.now(timezone.utc) - timedelta(days=days), "step": timedelta(seconds=step_s),
              "head": head, "middle": middle, "tail": tail}
    return ([SQL.bench_history_events, SQL.bench_history_customers, SQL.bench_history_subscriptions,
             SQL.bench_history_entitlements],
            [SQL.bench_history_deliveries, SQL.bench_history_attempts, SQL.bench_history_invoices,
             SQL.bench_history_transitions],
            params)
