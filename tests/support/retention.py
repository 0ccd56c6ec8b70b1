"""Retention's test ledger: events in every state, old and new, with the rows that name them
(tests/integration/test_retention.py, test_retention_s3.py, test_cli_retention.py)."""
from __future__ import annotations

import json
import time

import pytest

from devkit.factories import customer, event
from ledger.deliveries import IncomingEvent
from ledger.retention import Retention, RetentionPolicy
from tests.support.workers import RecordingWaker

LEDGER_TABLES = ("events", "deliveries", "attempts", "audit", "outbox", "health_alerts", "snapshot_twins",
                 "replay_job_events")
DAY = 86400


def record(kit, evt: dict) -> str:
    """A delivery as Stripe sends it: the body pretty-printed, so its exact bytes matter."""
    kit.store().record_delivery(IncomingEvent(id=evt["id"], type=evt["type"], created=evt["created"],
                                              livemode=evt["livemode"], api_version=evt["api_version"],
                                              account=None, payload=json.dumps(evt, indent=2)))
    return evt["id"]


def a_customer_event(created: int, customer_id: str | None = None) -> dict:
    return event("customer.updated", customer(created=created, customer_id=customer_id), created=created)


def processed(kit, evt: dict, *, days_ago: float) -> str:
    event_id = record(kit, evt)
    assert kit.processor(waker=RecordingWaker()).process(event_id).value == "processed"
    kit.execute("UPDATE ledger.events SET processed_at = now() - make_interval(secs => %s) WHERE id = %s",
                (days_ago * DAY, event_id))
    return event_id


def failed_permanent(kit, evt: dict, *, days_ago: float) -> str:
    event_id = record(kit, evt)
    kit.execute("UPDATE ledger.events SET status = 'failed_permanent', failure_reason = 'unmappable_payload', "
                "last_error = 'no id', updated_at = now() - make_interval(secs => %s) WHERE id = %s",
                (days_ago * DAY, event_id))
    return event_id


def ledger_rows(kit, ids) -> dict[str, list[str]]:
    """Every row of every ledger table that names these events, as text (payload bytes included)."""
    rows = {}
    for table in LEDGER_TABLES:
        column = "id" if table == "events" else "event_id"
        found = kit.query(f"SELECT row_to_json(t)::text AS r FROM ledger.{table} t WHERE {column} = ANY(%s)",
                          (list(ids),))
        rows[table] = sorted(r["r"] for r in found)
    return rows


@pytest.fixture
def mixed_ledger(kit):
    """Events in every state, old and new; ``leave`` are the ones retention (30 / 60 days) may remove."""
    return build_mixed_ledger(kit)


@pytest.fixture
def partitioned_kit(fresh_db, settings):
    """A LedgerKit on a database of its own, migrated and partitioned (``ledgerctl partitions migrate`` on
    an empty ledger): the session's database keeps the shape a ledger has before an operator chooses."""
    import dataclasses

    import psycopg

    from ledger.migrate import migrate
    from ledger.partition_migration import PartitionMigration
    from tests.support.handlers_for_tests import ensure_test_tables
    from tests.support.workers import LedgerKit

    migrate(fresh_db)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        ensure_test_tables(conn)
    k = LedgerKit(dataclasses.replace(settings, database_url=fresh_db))
    assert PartitionMigration(k.pool("migration")).run().status == "done"
    yield k
    k.close()


def build_mixed_ledger(kit) -> dict:
    old = int(time.time()) - 200 * DAY
    ids = {}
    ids["processed_old"] = processed(kit, a_customer_event(old), days_ago=45)
    ids["processed_old_2"] = processed(kit, a_customer_event(old + 1), days_ago=45)
    ids["processed_new"] = processed(kit, a_customer_event(old + 2), days_ago=10)
    ids["failed_old"] = failed_permanent(kit, a_customer_event(old + 3), days_ago=90)
    ids["failed_in_window"] = failed_permanent(kit, a_customer_event(old + 4), days_ago=45)
    ids["received_old"] = record(kit, a_customer_event(old + 5))
    ids["recoverable_old"] = record(kit, a_customer_event(old + 6))
    kit.execute("UPDATE ledger.events SET status = 'failed_recoverable', failure_reason = 'db_unavailable', "
                "next_attempt_at = now() + interval '1 hour', updated_at = now() - interval '300 days', "
                "received_at = now() - interval '300 days' WHERE id = %s", (ids["recoverable_old"],))
    ids["processing_old"] = record(kit, a_customer_event(old + 7))
    kit.execute("UPDATE ledger.events SET status = 'processing', lease_owner = 'w', "
                "lease_expires_at = now() + interval '1 minute' WHERE id = %s", (ids["processing_old"],))
    ids["held_by_id"] = processed(kit, a_customer_event(old + 8), days_ago=45)
    ids["held_by_customer"] = processed(kit, a_customer_event(old + 9, customer_id="cus_held"), days_ago=45)
    ids["effect_pending"] = processed(kit, a_customer_event(old + 10), days_ago=45)
    ids["effect_sent"] = processed(kit, a_customer_event(old + 11), days_ago=45)
    for event_id, status, sent in ((ids["effect_pending"], "pending", None), (ids["effect_sent"], "sent", "now()")):
        kit.execute("INSERT INTO ledger.outbox (idempotency_key, effect, event_id, event_created, payload, status, sent_at) "
                    f"SELECT %s, 'test.effect', id, stripe_created, '{{\"n\": 1}}', %s, {sent or 'NULL'} "
                    "FROM ledger.events WHERE id = %s", (f"{event_id}:test.effect", status, event_id))
    # An operator's replay in its audit, and a second delivery: rows that must leave and come back too.
    kit.execute("INSERT INTO ledger.audit (event_id, event_created, action, actor, reason, from_status) "
                "SELECT id, stripe_created, 'replay', 'ops@example.test', 'fix', 'failed_permanent' "
                "FROM ledger.events WHERE id = %s", (ids["failed_old"],))
    kit.execute("INSERT INTO ledger.deliveries (event_id, event_created, source) "
                "SELECT id, stripe_created, 'catchup' FROM ledger.events WHERE id = %s", (ids["processed_old"],))
    holds = Retention(kit.pool("retention"), None, RetentionPolicy())
    ids["event_hold"] = holds.hold(event_id=ids["held_by_id"], reason="dispute", actor="ops@example.test")
    holds.hold(customer_id="cus_held", reason="the customer asked", actor="ops@example.test")
    ids["leave"] = {ids[k] for k in ("processed_old", "processed_old_2", "failed_old", "effect_sent")}
    return ids
