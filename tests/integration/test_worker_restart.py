"""A Postgres restart kills every pooled connection of a worker: its next claim and
its next failure record still land, on a fresh connection. Private server only."""
from __future__ import annotations

import time

import psycopg
import pytest

from ledger.config import Settings
from ledger.db import ProcessPool
from ledger.migrate import migrate
from ledger.states import EventStatus
from ledger.deliveries import EventStore
from ledger.attempts import FailureRecord, WorkerLedger
from devkit.factories import event, incoming
from tests.support.workers import claim_one


@pytest.fixture
def restarted(private_postgres):
    """A ledger with three received events, a worker pool that has used a connection, then a restart."""
    url = private_postgres.url
    migrate(url)
    settings = Settings(database_url=url, db_pool_max_size=1)
    receiver_pool, worker_pool = ProcessPool(settings, name="receiver"), ProcessPool(settings, name="worker")
    store = EventStore(receiver_pool)
    events = [event("test.effect", {"id": f"obj_{n}"}, created=int(time.time())) for n in range(3)]
    for evt in events:
        store.record_delivery(incoming(evt))
    ledger = WorkerLedger(worker_pool)
    assert claim_one(ledger, events[0]["id"], worker="host:1", lease_s=30) is not None  # a live pooled connection
    private_postgres.stop()
    private_postgres.start()
    yield ledger, [evt["id"] for evt in events], url
    receiver_pool.close()
    worker_pool.close()


def test_the_first_claim_after_a_postgres_restart_succeeds(restarted):
    ledger, ids, url = restarted

    claim = claim_one(ledger, ids[1], worker="host:1", lease_s=30)

    assert claim is not None and claim.event_id == ids[1]


def test_the_first_failure_record_after_a_postgres_restart_lands(private_postgres):
    url = private_postgres.url
    migrate(url)
    settings = Settings(database_url=url, db_pool_max_size=1)
    pool = ProcessPool(settings, name="worker")
    evt = event("test.effect", {"id": "obj_f"}, created=int(time.time()))
    EventStore(pool).record_delivery(incoming(evt))
    ledger = WorkerLedger(pool)
    claim = claim_one(ledger, evt["id"], worker="host:1", lease_s=30)
    private_postgres.stop()
    private_postgres.start()

    ledger.fail(claim, FailureRecord(EventStatus.FAILED_RECOVERABLE, "database_unavailable", "OperationalError",
                                     "connection lost", delay_s=1.0))

    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT status FROM ledger.events WHERE id = %s", (evt["id"],)).fetchone() == \
            ("failed_recoverable",)
    pool.close()
