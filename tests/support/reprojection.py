"""What the re-projection tests share: a planted handler bug, whole-table snapshots keyed the way the
diff keys rows, and events written straight into the ledger as processed (for rebuilds of many events).

The planted bug (``plant_bug``, or loading this module as a handler module in a worker process:
``LEDGER_HANDLER_MODULES=tests.support.reprojection``) makes the built-in subscription mapping map
``past_due`` to ``active`` and drop ``cancel_at_period_end``. It registers no handler.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from datetime import datetime, timezone

from psycopg.types.json import Json

from devkit.factories import SubscriptionHistory
from ledger.migrate import migrate
from workers.billing import mapping

# Each billing table's rows are matched on this (the diff's key: primary key, or billing.objects' unique key).
KEYS = {"customers": ("id",), "subscriptions": ("id",), "invoices": ("id",), "checkout_sessions": ("id",),
        "entitlements": ("customer_id", "feature", "source"), "entitlement_summaries": ("customer_id",),
        "subscription_transitions": ("event_id",), "objects": ("id", "account", "livemode")}
# When a row was written, not what it says: left out of every comparison.
WRITTEN_AT = ("updated_at", "recorded_at", "granted_at")
MODULE = __name__
_fixed_subscription_row = mapping.subscription_row


def buggy_subscription_row(obj, entitlements_map=None):
    row = _fixed_subscription_row(obj, entitlements_map or {})
    if row["status"] == "past_due":
        row["status"] = "active"
    row["cancel_at_period_end"] = False
    return row


def plant_bug(monkeypatch) -> None:
    monkeypatch.setattr(mapping, "subscription_row", buggy_subscription_row)


if os.environ.get("LEDGER_HANDLER_MODULES", "").find(MODULE) >= 0:
    mapping.subscription_row = buggy_subscription_row  # a worker process that loads this module as its handlers


def tables(query, schema: str = "billing") -> dict[str, dict[tuple, dict]]:
    """Every row of every billing table (of ``schema``), by key, without the written-at columns."""
    found = {}
    for table, key in KEYS.items():
        rows = query(f"SELECT to_jsonb(t) AS r FROM {schema}.{table} t")
        found[table] = {tuple(r["r"][k] for k in key): {c: v for c, v in r["r"].items() if c not in WRITTEN_AT}
                        for r in rows}
    return found


def differing(a: dict, b: dict) -> set[tuple[str, tuple]]:
    """(table, key) of every row that is in one snapshot and not the other, or differs."""
    return {(table, key) for table in KEYS for key in set(a[table]) | set(b[table])
            if a[table].get(key) != b[table].get(key)}


def lifecycles(count: int, *, start: int | None = None, cut_at: int | None = None) -> list[dict]:
    """``count`` subscription lifecycles' events, their clocks interleaved; history n keeps its first
    ``cut_at(n)`` events, so some end past_due or about to cancel (where the planted bug shows)."""
    start = start or int(time.time()) - 90 * 86400
    events = []
    for n in range(count):
        history = SubscriptionHistory(start=start + n).lifecycle().events
        keep = len(history) - (n % 6) if cut_at is None else cut_at
        events.extend(history[:keep])
    return sorted(events, key=lambda e: (e["created"], e["id"]))


def insert_processed(kit, events: list[dict]) -> None:
    """``events`` written straight into the ledger as processed (no worker ran them): a history to rebuild."""
    rows = [(e["id"], e["type"], datetime.fromtimestamp(e["created"], tz=timezone.utc), e["livemode"],
             e.get("api_version"), e.get("account"), Json(e)) for e in events]
    with kit.connect() as conn, conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO ledger.events (id, type, status, stripe_created, livemode, api_version, account, payload, "
            "processed_at) VALUES (%s, %s, 'processed', %s, %s, %s, %s, %s, now())", rows)


def ledger_state(query) -> str:
    """ledger.events, attempts and outbox, every column: what a rebuild must never change."""
    return json.dumps([query(f"SELECT to_jsonb(t) AS r FROM ledger.{t} t ORDER BY to_jsonb(t)::text")
                       for t in ("events", "attempts", "outbox")], sort_keys=True, default=str)


def reference_ledger(fresh_db, settings):
    """A second ledger, empty (a fixture's body: ``reference = pytest.fixture(rp.reference_ledger)``): processed
    from the start by the fixed handlers, it holds what an apply must give."""
    from tests.support.workers import LedgerKit  # not at import: worker processes load this module as handlers

    migrate(fresh_db)
    kit = LedgerKit(dataclasses.replace(settings, database_url=fresh_db))
    yield kit
    kit.close()
