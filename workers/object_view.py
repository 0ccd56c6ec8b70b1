"""One Stripe object's story: the events that touched it, and its rows three ways.

For any object id the ledger has seen (``ledgerctl objects show``):

* its events, in Stripe's order ``(created, id)``, each with status, attempts, last failure,
  deliveries, replays and API version (ledger.operator's ``object_events``); a customer's
  view also rebuilds from the events of its other objects, since its entitlements derive from
  its subscriptions;
* per billing table that holds it, each row **live** (as it is now), **rebuilt** (what today's
  rebuilt handlers make of its processed events, as a rebuild takes them, in memory:
  workers/reproject.py's ``object_rows``, nothing written) and, on request only, **Stripe** (the
  object fetched from the API now, mapped as a backfill maps it, outside any transaction; a failed
  fetch is shown, not raised);
* the objects it is linked to, both ways (a customer's subscriptions and invoices, a
  subscription's customer and invoices).

What a difference means: live ≠ rebuilt = Stripe, a row the handlers would write differently
now (a handler bug, fixed since; or a row written by hand); live = rebuilt ≠ Stripe, an event
the ledger never received (a missed event: ``ledgerctl catchup`` or ``backfill``). Columns
that only say when a row was written (a DEFAULT now()) are not compared.
"""
from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any, Callable

from psycopg.rows import dict_row

from ledger import inputs
from ledger.db import ProcessPool
from ledger.operator import OperatorLedger
from ledger.reprojection import StoredEvent
from ledger.states import EventStatus
from workers import rowsql
from workers.billing.snapshots import write_object
from workers.billing.tables import (CHECKOUT_SESSIONS, CUSTOMERS, ENTITLEMENT_SUMMARIES, ENTITLEMENTS, INVOICES,
                                    OBJECTS, SUBSCRIPTIONS, TRANSITIONS)
from workers.registry import HandlerRegistry
from workers.reproject import object_rows
from workers.rows import Table
from workers.thin import collection_path
from workers.writers import RENDERED, MemoryWriter, rows_json

# An id as Stripe writes them: a prefix, an underscore, then letters, digits and underscores.
OBJECT_ID = re.compile(r"[a-z][a-z0-9]*_[A-Za-z0-9_]+")

# Each billing table that holds an object's rows, and the column that names the object.
HOLDERS: tuple[tuple[Table, str], ...] = (
    (CUSTOMERS, "id"), (SUBSCRIPTIONS, "id"), (INVOICES, "id"), (CHECKOUT_SESSIONS, "id"), (OBJECTS, "id"),
    (TRANSITIONS, "subscription_id"), (ENTITLEMENTS, "customer_id"), (ENTITLEMENT_SUMMARIES, "customer_id"))

# The links between objects: the table whose rows name another object, by which column.
LINKS: tuple[tuple[Table, str, str], ...] = (
    (SUBSCRIPTIONS, "customer_id", "subscriptions"), (INVOICES, "customer_id", "invoices"),
    (INVOICES, "subscription_id", "invoices"), (CHECKOUT_SESSIONS, "customer_id", "checkout_sessions"))


def object_id(value: object) -> str:
    """``value`` if it has the shape of a Stripe id; InputError (a 4xx, exit 2) otherwise."""
    text = inputs.text("object id", value)
    if not OBJECT_ID.fullmatch(text):
        raise inputs.InputError("object id is a Stripe id: a prefix, '_', then letters, digits or '_' "
                                "(cus_..., sub_..., in_..., evt_...)")
    return text


class ObjectView:
    def __init__(self, pool: ProcessPool, registry: HandlerRegistry, *,
                 stripe_api: Callable[[], Any] | None = None):
        self._pool = pool
        self._registry = registry
        self._stripe_api = stripe_api

    def show(self, object_id: str, *, stripe: bool = False) -> dict[str, Any] | None:
        """The object's events, rows and links; None when the ledger has neither an event nor a row of it."""
        found = OperatorLedger(self._pool).object_events(object_id)
        events = [e for e in found if e["own"]]
        # As a rebuild: from processed events only. One still waiting or failing is in the list, with its
        # status, and not in the rebuilt rows (live = rebuilt then, until a worker applies it).
        applied = [StoredEvent.from_row(e) for e in found if e["status"] == EventStatus.PROCESSED.value]
        rebuilt = object_rows(self._registry, applied)
        with self._pool.get().connection() as conn:
            live = {table: live_rows(conn, table, column, [object_id]) for table, column in HOLDERS}
            if not events and not any(live.values()):
                return None
            object_type = _object_type(events, live)
            account = events[-1]["account"] if events else None
            fetched = self._fetch(object_type, object_id, account) if stripe else None
            stripe_rows = _rows_of_object(fetched["object"], account) if fetched and fetched["object"] else None
            tables = []
            for table, column in HOLDERS:
                mine = lambda rows: [r for r in rows if r.get(column) == object_id]  # noqa: E731
                sides = {"live": live[table], "rebuilt": stored_form(conn, table, mine(rebuilt.get(table.name, [])))}
                if stripe_rows is not None and table.name in stripe_rows:  # a fetch writes no history
                    sides["stripe"] = stored_form(conn, table, mine(stripe_rows[table.name]))
                if any(sides.values()):
                    tables.append({"table": table.name, "key": list(table.key), "rows": side_by_side(table, sides)})
            links = _links(conn, object_id, live)
        return {"id": object_id, "object": object_type, "events": [_listed(e) for e in events], "tables": tables,
                "links": links, "stripe": fetched, "rebuilt_from": len(applied)}

    def _fetch(self, object_type: str | None, object_id: str, account: str | None) -> dict[str, Any]:
        """Stripe's object now, or why not: never raised, so the rest of the page still shows."""
        path = collection_path(object_type) if object_type else None
        if path is None:
            return {"object": None, "error": f"objects of type {object_type or 'unknown'} cannot be fetched here"}
        try:
            api = self._stripe_api()
            try:
                obj, fetched_at = api.retrieve(path, object_id, account=account)
            finally:
                api.close()
        except Exception as exc:  # noqa: BLE001 - Stripe's refusal, a missing key, an unreachable API: all shown
            return {"object": None, "error": f"{type(exc).__name__}: {exc}"}
        if obj is None:
            return {"object": None, "error": "Stripe answers 404: no such object (or no longer)"}
        return {"object": obj, "fetched_at": fetched_at.isoformat(), "error": None}


def _listed(event: dict) -> dict[str, Any]:
    return {k: event[k] for k in ("id", "type", "status", "attempts", "failure_reason", "last_error",
                                  "stripe_created", "api_version", "deliveries", "replays", "livemode", "account")}


def _object_type(events: list[dict], live: dict[Table, list[dict]]) -> str | None:
    for event in reversed(events):
        obj = ((event["payload"] or {}).get("data") or {}).get("object")
        if isinstance(obj, dict) and isinstance(obj.get("object"), str):
            return obj["object"]
    mirrored = live.get(OBJECTS) or []
    return mirrored[0]["object_type"] if mirrored else None


def _rows_of_object(obj: dict, account: str | None) -> dict[str, list[dict]]:
    """A fetched object's rows, as a backfill would write them (its order key: now), in memory."""
    writer = MemoryWriter()
    write_object(writer.rows_for(event_id="api_fetch", created=datetime.now(timezone.utc), account=account,
                                 livemode=bool(obj.get("livemode"))), obj)
    writer.flush()
    return writer.tables()


def live_rows(conn, table: Table, column: str, values: list[str]) -> list[dict]:
    """``table``'s rows whose ``column`` is one of ``values``, as the page and a repair compare them."""
    text = RENDERED.get(("object-rows", table.name, column), lambda: rowsql.rows_where(table, column))
    return [r["row"] for r in conn.cursor(row_factory=dict_row).execute(text, {"values": values})]


def stored_form(conn, table: Table, rows: list[dict]) -> list[dict]:
    """Rows made in memory as Postgres stores them (its types, its text of a time), to compare with live."""
    if not rows:
        return []
    text = RENDERED.get(("stored-form", table.name), lambda: rowsql.as_stored(table))
    return [r["row"] for r in conn.cursor(row_factory=dict_row).execute(text, {"rows": rows_json(rows)})]


def side_by_side(table: Table, sides: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """Per key: each side's row (None where it has none), and the columns whose values differ. Stripe's
    row is compared on the columns handlers map (its order key is the fetch's, not an event's)."""
    keyed: dict[tuple, dict[str, Any]] = {}
    for side, rows in sides.items():
        for row in rows:
            keyed.setdefault(tuple(str(row.get(c)) for c in table.key), dict.fromkeys(sides))[side] = row
    out = []
    for key, found in sorted(keyed.items()):
        columns = sorted({c for r in found.values() if r is not None for c in r})
        differ = [c for c in columns
                  if len({repr(r.get(c)) if r is not None else "(no row)" for side, r in found.items()
                          if side != "stripe" or c in table.columns}) > 1]
        out.append({"key": dict(zip(table.key, key)), **found, "differs": differ})
    return out


def _links(conn, object_id: str, live: dict[Table, list[dict]]) -> dict[str, list[str]]:
    """The objects this one names (its customer, its subscription) and those that name it."""
    links: dict[str, set[str]] = {}
    for table in (SUBSCRIPTIONS, INVOICES, CHECKOUT_SESSIONS):
        for row in live.get(table, []):
            for column, name in (("customer_id", "customer"), ("subscription_id", "subscription")):
                if row.get(column):
                    links.setdefault(name, set()).add(row[column])
    for table, column, name in LINKS:
        links.setdefault(name, set()).update(r["id"] for r in live_rows(conn, table, column, [object_id]))
    return {name: sorted(ids) for name, ids in links.items() if ids}
