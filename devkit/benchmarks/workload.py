"""Workloads: backlogs of received events, wake-ups, pgbench scripts, and the 1M-event history.

A backlog is loaded straight into the ledger (the rows the receiver would have
written: ``ledger.events`` as ``received`` plus one ``ledger.deliveries`` row each)
and its wake-ups are pushed to the broker queue before any worker starts, so a
drain measures the workers alone.
"""
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
from psycopg import sql as pg_sql
import redis

from devkit.sql import SQL, compose
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


# The fields of ledger.deliveries.IncomingEvent (what the receiver records) plus what pgbench replays;
# a type of its own so that the benchmark's extras stay out of the product's.
@dataclass(frozen=True)
class BacklogEvent:
    id: str
    type: str
    created: int
    livemode: bool
    api_version: str | None
    account: str | None
    body: str
    params: dict[str, Any]  # what the worker's handler passes to its statements (pgbench replays it)


class EventSource:
    """Lifecycle events generated once and re-issued per backlog under fresh ids (every id,
    event and object alike, is re-tagged, so each backlog is new customers, subscriptions and invoices)."""

    def __init__(self, events: list[dict[str, Any]]):
        self.events = events
        self.bodies = [body(e) for e in events]
        self.params = [_handler_params(e) for e in events]
        self._issued = 0

    def backlog(self, count: int) -> list[BacklogEvent]:
        self._issued += 1
        tag = f"{self._issued:04x}"
        out = []
        for i in range(count):
            evt = self.events[i % len(self.events)]
            if i and i % len(self.events) == 0:  # more than one pass: a new tag per pass
                self._issued += 1
                tag = f"{self._issued:04x}"
            base = self.params[i % len(self.events)]
            params = {**base, "values": {k: (_retag(v, tag) if isinstance(v, str) else v)
                                         for k, v in base["values"].items()}}
            out.append(BacklogEvent(id=_retag(evt["id"], tag), type=evt["type"], created=evt["created"],
                                    livemode=evt["livemode"], api_version=evt.get("api_version"),
                                    account=evt.get("account"), body=_retag(self.bodies[i % len(self.events)], tag),
                                    params=params))
        return out


class _NoRows:
    rowcount = 0
    description = None

    def fetchone(self):
        return None

    def fetchall(self):
        return []

    def __iter__(self):
        return iter(())


class _RecordingConnection:
    """Stands in for the apply transaction's connection: records what the handlers send."""

    def __init__(self):
        self.calls: list[tuple[str, Any]] = []

    def execute(self, sql, params=None, **_):
        self.calls.append((str(sql), params))
        return _NoRows()

    def cursor(self, *_, **__):
        return self


class _WriterConnection(_RecordingConnection):
    """The batch writer's view of a recording connection: its statements recorded there, and the row
    counts it reads back after writing empty (the handlers' own reads keep finding no row)."""

    def __init__(self, recording: _RecordingConnection):
        self.calls = recording.calls

    def execute(self, sql, params=None, **_):
        self.calls.append((str(sql), params))
        return self

    def fetchone(self):
        return ()

    def fetchall(self):
        return []


_REGISTRY = None


def _handler_calls(evt: dict[str, Any]) -> list[tuple[str, Any]]:
    """The statements (and parameters) the registered handlers send for this event.

    Runs the real handler registry (built-in billing handlers, as a worker loads
    them) against a recording connection whose queries return no rows, their rows
    through the worker's own batch writer (a batch of this one event); so the
    drain's pgbench script follows whatever the handlers do today.
    """
    global _REGISTRY
    from workers.registry import ApplyContext, load_handlers
    from workers.writers import LiveWriter

    if _REGISTRY is None:
        _REGISTRY = load_handlers(Settings())
    conn = _RecordingConnection()
    writer = LiveWriter(_WriterConnection(conn))
    created = datetime.fromtimestamp(evt["created"], tz=timezone.utc)
    context = ApplyContext(conn=conn, event_id=evt["id"], event_type=evt["type"], created=created,
                           livemode=evt["livemode"], account=evt.get("account"), event=evt, attempt=1,
                           rows=writer.rows_for(event_id=evt["id"], created=created, account=evt.get("account"),
                                                livemode=evt["livemode"]))
    handlers = _REGISTRY.resolve(evt["type"])
    if not handlers:
        raise ValueError(f"no handler for {evt['type']}: a drain backlog must hold handled events")
    for handle in handlers:
        handle(context)
    writer.flush()
    return conn.calls


def _pg_text(value: Any) -> tuple[str | None, str]:
    """A parameter as pgbench text and the Postgres type to cast it back to."""
    from psycopg.types.json import Json, Jsonb

    if value is None:
        return None, ""
    if isinstance(value, bool):
        return ("true" if value else "false"), "boolean"
    if isinstance(value, int):
        return str(value), "bigint"
    if isinstance(value, float):
        return repr(value), "double precision"
    if isinstance(value, datetime):
        return value.isoformat(), "timestamptz"
    if isinstance(value, (Json, Jsonb)):
        return json.dumps(value.obj), "jsonb" if isinstance(value, Jsonb) else "json"
    if isinstance(value, (list, tuple)):
        items = ['"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"' for v in value]
        return "{" + ",".join(items) + "}", "text[]"
    if isinstance(value, dict):
        return json.dumps(value), "jsonb"
    return str(value), "text"


def _handler_params(evt: dict[str, Any]) -> dict[str, Any]:
    """{"statements": (sql, ...), "values": {column: text}, "types": {column: type}} for one event."""
    statements, values, types = [], {}, {}
    for j, (sql, params) in enumerate(_handler_calls(evt)):
        statements.append(sql)
        items = params.items() if isinstance(params, dict) else enumerate(params or ())
        for name, value in items:
            text, kind = _pg_text(value)
            values[f"p{j}_{name}"] = text
            if kind:
                types[f"p{j}_{name}"] = kind
    return {"statements": tuple(statements), "values": values, "types": types}


# -- loading -----------------------------------------------------------------------------------

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
    """The message ``Waker.wake`` publishes to Redis for a wake-up on ``queue``, as a dict.

    Published by the Waker itself through a queue of its own (so that a running worker
    cannot take it) and read back; ``WakeupMessage`` makes the message of any event id from it.
    """
    client = redis.Redis.from_url(broker_url)
    try:
        probe_queue = f"{queue}.template-{uuid.uuid4().hex[:8]}"
        app = make_celery(Settings(broker_url=broker_url, queue_name=probe_queue), publisher_only=True)
        if not Waker(app).wake(f"evt_probe_{uuid.uuid4().hex}"):
            raise RuntimeError("could not publish a wake-up to the private Redis")
        app.close()
        template = json.loads(client.rpop(probe_queue))
        client.delete(probe_queue)
    finally:
        client.close()
    template["properties"]["delivery_info"] = {**template["properties"]["delivery_info"], "routing_key": queue}
    return template


class WakeupMessage:
    """Wake-up messages for any event id, from ``wakeup_template``'s message: its task arguments are
    decoded once, each ``for_event`` replaces the id and the message ids."""

    def __init__(self, template: dict[str, Any]):
        self.template = template
        _, self.kwargs, self.embed = json.loads(base64.b64decode(template["body"]))

    def for_event(self, event_id: str) -> str:
        template = self.template
        task_id = str(uuid.uuid4())
        message = dict(template)
        message["body"] = base64.b64encode(json.dumps([[event_id], self.kwargs, self.embed]).encode()).decode()
        message["headers"] = {**template["headers"], "id": task_id, "root_id": task_id,
                              "argsrepr": repr([event_id])}
        message["properties"] = {**template["properties"], "correlation_id": task_id,
                                 "delivery_tag": str(uuid.uuid4())}
        return json.dumps(message)


def push_wakeups(broker_url: str, queue: str, event_ids: list[str]) -> None:
    """One wake-up per id, in order, byte for byte what ``Waker.wake`` publishes.

    The first is published by the Waker itself and read back as the template; the
    rest are the same message with the id (and message ids) replaced, pushed in
    pipelined batches (publishing 20,000 one by one would dominate the set-up time).
    """
    if not event_ids:
        return
    messages = WakeupMessage(wakeup_template(broker_url, queue))
    client = redis.Redis.from_url(broker_url)
    try:
        pipe = client.pipeline(transaction=False)
        for index, event_id in enumerate(event_ids, start=1):
            pipe.lpush(queue, messages.for_event(event_id))
            if index % 2000 == 0:
                pipe.execute()
        pipe.execute()
    finally:
        client.close()


def drop_queue(broker_url: str, queue: str) -> None:
    client = redis.Redis.from_url(broker_url)
    try:
        client.delete(queue, "unacked", "unacked_index")
    finally:
        client.close()


def redis_commands(broker_url: str) -> dict[str, int]:
    client = redis.Redis.from_url(broker_url)
    try:
        return {k.removeprefix("cmdstat_"): v["calls"] for k, v in client.info("commandstats").items()}
    finally:
        client.close()


# -- pgbench scripts ----------------------------------------------------------------------------

class DrainScript:
    """What a worker sends Postgres for one event, as one pgbench transaction, for a backlog.

    The ledger's own statements are the named ones the worker runs (event_claim,
    then BEGIN, event_lock_if_lease_held, the handlers' statements,
    event_finish_if_lease_held, COMMIT); the handlers' statements are those the
    registered handlers sent for each event (see ``_handler_calls``), one \\if
    branch per distinct sequence. Added: one primary-key SELECT of the event's
    parameters from bench.drain_work (the worker maps them from the payload in
    Python), so the limit it measures is, if anything, understated.
    """

    def __init__(self, events: list[BacklogEvent]):
        self.events = events
        self.kinds: dict[tuple[str, ...], int] = {}
        self.types: dict[str, str] = {}
        for e in events:
            self.kinds.setdefault(e.params["statements"], len(self.kinds) + 1)
            for col, kind in e.params["types"].items():
                self.types.setdefault(col, kind)
        self.columns = sorted({c for e in events for c in e.params["values"]},
                              key=lambda c: (int(c[1:].split("_", 1)[0]), c))

    def _var(self, j: int):
        def var(name: str) -> str:
            col = f"p{j}_{name}"
            return f"nullif(:{col}, '')::{self.types.get(col, 'text')}"
        return var

    def text(self) -> str:
        # "ids": a claim of the wake-ups a worker holds, here the one event (a one-element array).
        ledger = {"id": ":ev_id", "ids": "ARRAY[:ev_id]::text[]", "worker": ":worker",
                  "lease_owner": ":lease_owner", "lease_s": ":lease_s", "attempt": ":cl_attempts",
                  "created": "(:cl_stripe_created)::timestamptz",
                  "liveness_key": "NULL::bigint"}  # a lease alone, as a worker without liveness claims
        lines = ["\\set i :i + 1",
                 "\\set n :client_id + 1 + :nclients * (:i - 1)",
                 pgbench_sql(SQL.bench_drain_work_row, var=lambda p: ":n").rstrip(";") + " \\gset",
                 pgbench_sql(LEDGER_SQL.event_claim, var=lambda p: ledger[p]).rstrip(";") + "\n\\gset cl_",
                 "BEGIN;",
                 pgbench_sql(LEDGER_SQL.event_lock_if_lease_held, var=lambda p: ledger[p])]
        for statements, kind in self.kinds.items():
            lines.append(f"\\{'if' if kind == 1 else 'elif'} :kind = {kind}")
            for j, sql in enumerate(statements):
                lines.append(pgbench_sql(sql.replace("%%", "%"), var=self._var(j)))
        lines.append("\\endif")
        lines.append(pgbench_sql(LEDGER_SQL.event_finish_if_lease_held, var=lambda p: ledger[p]))
        lines.append("COMMIT;")
        return "\n".join(lines) + "\n"

    def statements_per_event(self) -> float:
        """Statements (BEGIN and COMMIT included) the script sends per event, without the parameter fetch."""
        per_kind = {k: len(s) for s, k in self.kinds.items()}
        return sum(4 + 1 + per_kind[self.kinds[e.params["statements"]]] for e in self.events) / len(self.events)

    def load(self, url: str) -> None:
        cols = self.columns
        typed = pg_sql.SQL("").join(pg_sql.SQL(", {} text").format(pg_sql.Identifier(c)) for c in cols)
        named = pg_sql.SQL("").join(pg_sql.SQL(", {}").format(pg_sql.Identifier(c)) for c in cols)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(SQL.bench_drain_work_drop)
            conn.execute(compose(SQL.bench_drain_work_create, parameter_columns=typed))
            with conn.cursor().copy(compose(SQL.bench_drain_work_copy, parameter_columns=named)) as copy:
                for n, e in enumerate(self.events, start=1):
                    values = e.params["values"]
                    copy.write_row((n, e.id, self.kinds[e.params["statements"]], f"pgbench:{n}", uuid.uuid4().hex,
                                    *(values.get(c) for c in cols)))
            conn.execute(SQL.bench_drain_work_analyze)


def ingest_scripts(work_dir: Path, deliveries_sample: list) -> tuple[list[Path], dict[str, str]]:
    """The receiver's INSERT ... ON CONFLICT (event_record_delivery) of the same payloads, one per transaction.

    The event id is built in SQL from a random number (pgbench has no string
    variables); every other parameter is one of the sampled deliveries, verbatim.
    """
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
            value = values.get(name)
            if value:
                defines[f"{key}{k}"] = value
                names[name] = f":{key}{k}::text"
            else:
                names[name] = "NULL::text"
        path = work_dir / f"ingest-{k}.sql"
        path.write_text("\\set r random(1, 1000000000000000)\n"
                        + pgbench_sql(LEDGER_SQL.event_record_delivery, var=lambda p: names[p]) + "\n")
        scripts.append(path)
    return scripts, defines


# -- the 1M-event history (scale) ---------------------------------------------------------------

# A lifecycle of ten events, as the factories build it: (event type, subscription status after it).
HISTORY_TYPES = ["customer.created", "customer.subscription.created", "customer.subscription.updated",
                 "invoice.paid", "invoice.payment_failed", "customer.subscription.updated", "invoice.paid",
                 "customer.subscription.updated", "customer.subscription.updated", "customer.subscription.deleted"]


def history_sql(total: int, payload_template: str, *, days: float = 400.0,
                step_s: float = 30.0) -> tuple[list[str], list[str], dict[str, Any]]:
    """Set-based statements (devkit/sql/bench_load.sql) that write ``total`` processed events
    (one delivery and one attempt each) and the business rows their lifecycles leave: a
    customer, a subscription (half of them canceled, half active with two entitlements),
    two invoices and six subscription transitions per ten events; and their parameters.

    Two lists of about equal cost that may run at once on two connections
    (foreign-key triggers off: the rows are consistent by construction).
    ``payload_template`` holds ``__EVT__`` and ``__CUS__`` where the ids go. Event g is received
    ``days`` ago plus ``step_s`` seconds per event.
    """
    head, rest = payload_template.split("__EVT__", 1)
    middle, tail = rest.split("__CUS__", 1)
    params = {"total": total, "lifecycles": total // 10, "types": HISTORY_TYPES,
              "start": datetime.now(timezone.utc) - timedelta(days=days), "step": timedelta(seconds=step_s),
              "head": head, "middle": middle, "tail": tail}
    # customers, subscriptions and entitlements go with the events; the rest with the deliveries.
    return ([SQL.bench_history_events, SQL.bench_history_customers, SQL.bench_history_subscriptions,
             SQL.bench_history_entitlements],
            [SQL.bench_history_deliveries, SQL.bench_history_attempts, SQL.bench_history_invoices,
             SQL.bench_history_transitions],
            params)
