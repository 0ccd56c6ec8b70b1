"""Objects fetched from the Stripe API (backfill, reconcile --fix, health alerts), applied as the
billing handlers apply events.

The same mapping (workers/billing/mapping.py) and the same guarded statements
(workers/billing/billing.sql) as the event handlers, and always the generic mirror
billing.objects. A fetched object has no event: its ordering key is (the second its
request was sent, less a margin: workers/stripe_api.py says why; 'api_fetch').
'api_fetch' sorts before every 'evt_...' id, so an event created in that second or
later wins over the snapshot, and an event of an earlier second loses to it,
whichever is applied first (docs/stripe-api.md, "Fetched objects and the order guard", says why
that converges).

A snapshot records no billing.subscription_transitions row (that table is the history
of events) and announces no effect: an effect is keyed by the event that caused it,
and the outbox's rows belong to events. A subscription's entitlements are derived
again, as an event's are.
"""
from __future__ import annotations

import functools
from datetime import datetime
from typing import Any, Callable, Mapping

import psycopg
from psycopg.types.json import Jsonb

from ledger.config import Settings
from workers.billing import mapping
from workers.billing.handlers import SQL, derive_entitlements, read_entitlements_map

# The ordering key's event id for a fetched object: below every "evt_..." (as text, 'a' < 'e').
API_FETCH = "api_fetch"


def ordering_key(fetched_at: datetime) -> tuple[datetime, str]:
    """(source_event_created, source_event_id) of an object fetched at ``fetched_at``."""
    if fetched_at.tzinfo is None:
        raise ValueError("fetched_at must be timezone-aware")
    return fetched_at.replace(microsecond=0), API_FETCH


def apply_object(conn: psycopg.Connection, obj: dict[str, Any], *, fetched_at: datetime,
                 account: str | None, livemode: bool,
                 entitlements_map: Mapping[str, list[str]] | None = None) -> bool:
    """Apply one fetched object in the caller's transaction; True if it wrote any row.

    Dispatches on ``obj["object"]`` to the typed table (customer, subscription, invoice,
    checkout.session), then upserts billing.objects. Raises what the mapping raises
    (UnmappablePayload, ObjectWithoutId: permanent errors) before writing anything
    when the object lacks a field its rows need; the guard's refusal of a row of
    another account or mode is a psycopg CheckViolation (constraint billing_row_owner).
    A subscription's features take ``entitlements_map`` (price/product id -> features)
    as the worker's handler does; without one, the map LEDGER_ENTITLEMENTS_MAP names
    (read once per file), so a backfilled subscription never loses a mapped feature.
    """
    created, event_id = ordering_key(fetched_at)
    stamp = {"event_id": event_id, "event_type": None, "event_created": created,
             "account": account, "livemode": livemode}
    mirror = mapping.object_row(obj, event_type=None)
    typed = _TYPED.get(mirror["object_type"])
    if typed:
        to_row, write = typed
        features_map = _configured_map() if entitlements_map is None else entitlements_map
        row = to_row(obj, features_map)  # mapped before any write: a refusal writes nothing
        wrote = write(conn, row, stamp)
    else:
        wrote = False
    wrote |= _written(conn.execute(SQL.object_upsert_if_newer, {**stamp, **mirror, "data": Jsonb(obj)}))
    return wrote


def _configured_map() -> Mapping[str, list[str]]:
    return _read_map(Settings.from_env().entitlements_map_path)


@functools.lru_cache(maxsize=4)
def _read_map(path: str | None) -> Mapping[str, list[str]]:
    return read_entitlements_map(path)


def _written(cur: psycopg.Cursor) -> bool:
    return cur.fetchone() is not None


def _customer(conn: psycopg.Connection, row: dict, stamp: dict) -> bool:
    return _written(conn.execute(SQL.customer_upsert_if_newer, {**row, **stamp, "metadata": Jsonb(row["metadata"])}))


def _subscription(conn: psycopg.Connection, row: dict, stamp: dict) -> bool:
    applied = conn.execute(SQL.subscription_apply_event,
                           {**row, **stamp, "from_status": None, "transition": False}).fetchone()[0]
    if applied:
        conn.execute(SQL.entitlements_lock_customer, {"customer_id": row["customer_id"]})
        derive_entitlements(conn, row["customer_id"])
    return applied


def _invoice(conn: psycopg.Connection, row: dict, stamp: dict) -> bool:
    return _written(conn.execute(SQL.invoice_upsert_if_newer, {**row, **stamp}))


def _checkout_session(conn: psycopg.Connection, row: dict, stamp: dict) -> bool:
    wrote = _written(conn.execute(SQL.checkout_session_upsert_if_newer, {**row, **stamp}))
    if row["customer_id"]:
        conn.execute(SQL.customer_insert_stub, {**stamp, "id": row["customer_id"]})
    return wrote


# obj["object"] -> (its row, as the event handler maps it, from the object and the entitlements map;
# the guarded write of that row). A fetched object says deleted: true where an event says *.deleted.
_TYPED: dict[str, tuple[Callable[[dict, Mapping], dict], Callable[[psycopg.Connection, dict, dict], bool]]] = {
    "customer": (lambda obj, _: mapping.customer_row(obj, deleted=False), _customer),
    "subscription": (mapping.subscription_row, _subscription),
    "invoice": (lambda obj, _: mapping.invoice_row(obj, deleted=obj.get("deleted") is True), _invoice),
    "checkout.session": (lambda obj, _: mapping.checkout_session_row(obj), _checkout_session),
}
