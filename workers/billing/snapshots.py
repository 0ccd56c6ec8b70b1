"""Objects fetched from the Stripe API (backfill, reconcile --fix, health alerts), applied as the
billing handlers apply events.

The same mapping (workers/billing/mapping.py) and the same tables and writer
(workers/billing/tables.py, workers/writers.py) as the event handlers, and always the generic mirror
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

from ledger.attempts import WorkerLedger
from ledger.config import Settings
from workers.billing import mapping
from workers.billing.handlers import link_customer, read_entitlements_map
from workers.billing.tables import CHECKOUT_SESSIONS, CUSTOMERS, INVOICES, OBJECTS, SUBSCRIPTION_ENTITLEMENTS, SUBSCRIPTIONS
from workers.handlers import object_keys
from workers.rows import EventRows
from workers.writers import LiveWriter

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
    checkout.session), then the generic mirror. Raises what the mapping raises
    (UnmappablePayload, ObjectWithoutId: permanent errors) before writing anything
    when the object lacks a field its rows need; the guard's refusal of a row of
    another account or mode is a psycopg CheckViolation (constraint billing_row_owner).
    A subscription's features take ``entitlements_map`` (price/product id -> features)
    as the worker's handler does; without one, the map LEDGER_ENTITLEMENTS_MAP names
    (read once per file), so a backfilled subscription never loses a mapped feature.

    The object's keys (its id, its customer's, its subscription's) are locked first, as a worker's
    batch locks them: the customer's entitlements are derived from all its subscriptions, which a
    worker may be writing at the same time.
    """
    created, event_id = ordering_key(fetched_at)
    writer = LiveWriter(conn)
    write_object(writer.rows_for(event_id=event_id, created=created, account=account, livemode=livemode), obj,
                 entitlements_map=entitlements_map)  # mapped before anything is locked or written
    WorkerLedger.lock_objects(conn, object_keys({"data": {"object": obj}}))
    return writer.flush() > 0


def write_object(rows: EventRows, obj: dict[str, Any], *,
                 entitlements_map: Mapping[str, list[str]] | None = None) -> None:
    """A fetched object's rows, through ``rows``: its typed table's (as the event handler maps it, but no
    transition: the transitions are the history of events, and a fetch is none), then the mirror's."""
    mirror = mapping.object_row(obj, event_type=None)
    typed = _TYPED.get(mirror["object_type"])
    if typed:
        to_row, write = typed
        features_map = _configured_map() if entitlements_map is None else entitlements_map
        write(rows, to_row(obj, features_map))
    rows.upsert(OBJECTS, mirror)


def _configured_map() -> Mapping[str, list[str]]:
    return _read_map(Settings.from_env().entitlements_map_path)


@functools.lru_cache(maxsize=4)
def _read_map(path: str | None) -> Mapping[str, list[str]]:
    return read_entitlements_map(path)


def _subscription(rows: EventRows, row: dict) -> None:
    rows.upsert(SUBSCRIPTIONS, row)
    rows.derive(SUBSCRIPTION_ENTITLEMENTS, row["customer_id"])


def _checkout_session(rows: EventRows, row: dict) -> None:
    rows.upsert(CHECKOUT_SESSIONS, row)
    if row["customer_id"]:
        link_customer(rows, row["customer_id"])


# obj["object"] -> (its row, as the event handler maps it, from the object and the entitlements map;
# how that row is written). A fetched object says deleted: true where an event says *.deleted.
_TYPED: dict[str, tuple[Callable[[dict, Mapping], dict], Callable[[EventRows, dict], None]]] = {
    "customer": (lambda obj, _: mapping.customer_row(obj, deleted=False), lambda rows, row: rows.upsert(CUSTOMERS, row)),
    "subscription": (lambda obj, features: mapping.subscription_row(obj, features), _subscription),
    "invoice": (lambda obj, _: mapping.invoice_row(obj, deleted=obj.get("deleted") is True),
                lambda rows, row: rows.upsert(INVOICES, row)),
    "checkout.session": (lambda obj, _: mapping.checkout_session_row(obj), _checkout_session),
}
