"""Migration 0006 (Stripe API, mirror, Connect) on a database of the previous release, and the delivery source."""
from __future__ import annotations

from dataclasses import replace

import psycopg
import pytest

from devkit.factories import event, incoming
from ledger.migrate import available_migrations, migrate
from ledger.queries import SQL

ACCOUNT = "acct_1Before"


def migrate_to(url: str, version: int) -> None:
    """The schema of the release whose last migration is ``version``, as ``ledgerctl migrate`` left it."""
    with psycopg.connect(url, autocommit=True) as conn:
        for migration in available_migrations()[:version]:
            with conn.transaction():
                conn.execute(SQL.migration_history_create)
                conn.execute(migration.sql)
                conn.execute(SQL.migration_record, {"version": migration.version, "name": migration.name,
                                                    "checksum": migration.checksum})


def test_rows_a_connect_event_wrote_before_the_migration_take_its_account(fresh_db):
    migrate_to(fresh_db, 5)
    connected = incoming(event("customer.updated", {"id": "cus_c"}, created=1_700_000_000, account=ACCOUNT))
    platform = incoming(event("customer.updated", {"id": "cus_p"}, created=1_700_000_000))
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        for evt in (connected, platform):
            # The previous release's receiver statement (no source) and billing upsert (no account).
            conn.execute("INSERT INTO ledger.events (id, type, stripe_created, livemode, account, payload) "
                         "VALUES (%s, %s, to_timestamp(%s), false, %s, %s::json)",
                         (evt.id, evt.type, evt.created, evt.account, evt.payload))
            conn.execute("INSERT INTO ledger.deliveries (event_id) VALUES (%s)", (evt.id,))
        for customer_id, evt in (("cus_c", connected), ("cus_p", platform)):
            conn.execute("INSERT INTO billing.customers (id, livemode, source_event_id, source_event_created) "
                         "VALUES (%s, false, %s, to_timestamp(%s))", (customer_id, evt.id, evt.created))
        conn.execute("INSERT INTO billing.subscriptions (id, customer_id, status, features, livemode, "
                     "source_event_id, source_event_created) VALUES ('sub_c', 'cus_c', 'active', '{sso}', false, "
                     "%s, now())", (connected.id,))
        conn.execute("INSERT INTO billing.entitlements (customer_id, feature, source) VALUES ('cus_c', 'sso', "
                     "'subscription')")

    assert [m.version for m in migrate(fresh_db)][0] == 6

    with psycopg.connect(fresh_db) as conn:
        assert conn.execute("SELECT id, account FROM billing.customers ORDER BY id").fetchall() == [
            ("cus_c", ACCOUNT), ("cus_p", None)]
        assert conn.execute("SELECT account FROM billing.subscriptions").fetchall() == [(ACCOUNT,)]
        assert conn.execute("SELECT account FROM billing.entitlements").fetchall() == [(ACCOUNT,)]
        # Deliveries recorded before it came from webhooks: the only source there was.
        assert conn.execute("SELECT DISTINCT source FROM ledger.deliveries").fetchall() == [("webhook",)]


def test_a_delivery_records_its_source_and_only_a_known_one(db, kit):
    evt = event("customer.updated", {"id": "cus_s", "object": "customer"}, created=1_700_000_000)
    store = kit.store()
    assert store.record_delivery(incoming(evt)).inserted is True
    assert store.record_delivery(replace(incoming(evt), source="catchup")).inserted is False  # same dedupe

    assert kit.query("SELECT source FROM ledger.deliveries ORDER BY delivered_at") == [
        {"source": "webhook"}, {"source": "catchup"}]
    with pytest.raises(psycopg.errors.CheckViolation, match="deliveries_source_known"):
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("INSERT INTO ledger.deliveries (event_id, event_created, source) "
                         "VALUES (%s, to_timestamp(%s), 'carrier pigeon')", (evt["id"], evt["created"]))
