"""One retry rule behind every ledger class (ledger/statements.py): after a Postgres restart
the outbox dispatcher's and the operator's next statements land on a fresh connection, as
the worker's do (test_worker_restart.py); a statement timeout is raised after one try, never
run twice. Restarts on a private server only."""
from __future__ import annotations

import dataclasses
import time

import psycopg
import pytest

from devkit.factories import event, incoming
from ledger.config import Settings
from ledger.db import ProcessPool
from ledger.errors import DatabaseUnavailable
from ledger.migrate import migrate
from ledger.operator import OperatorLedger
from ledger.outbox import OutboxLedger, record
from ledger.queries import SQL
from ledger.statements import run_statement
from ledger.deliveries import EventStore

TIMEOUT_MS = 1000


@pytest.fixture
def recorded(private_postgres):
    """One received event with one pending effect, and a pool (one connection) that has used its connection."""
    url = private_postgres.url
    migrate(url)
    pool = ProcessPool(Settings(database_url=url, db_pool_max_size=1), name="restart")
    evt = event("test.emit", {"id": "obj_r"}, created=int(time.time()))
    EventStore(pool).record_delivery(incoming(evt))
    with psycopg.connect(url) as conn:
        outbox_id = record(conn, idempotency_key=f"{evt['id']}:test.effect", effect="test.effect",
                           event_id=evt["id"], ordering_key=None, payload={})
    yield pool, evt["id"], outbox_id
    pool.close()


def test_the_first_outbox_claim_after_a_postgres_restart_succeeds(recorded, private_postgres):
    pool, _, outbox_id = recorded
    outbox = OutboxLedger(pool)
    assert outbox.stats()["depth"] == 1  # the pool's one connection is live, then dies with the server
    private_postgres.stop()
    private_postgres.start()

    claim = outbox.claim(outbox_id, lease_s=30)

    assert claim is not None and claim.id == outbox_id


def test_the_first_operator_statement_after_a_postgres_restart_succeeds(recorded, private_postgres):
    pool, event_id, _ = recorded
    operator = OperatorLedger(pool)
    assert operator.stats()["by_status"] == {"received": 1}
    private_postgres.stop()
    private_postgres.start()

    shown = operator.show(event_id)

    assert shown is not None and shown["event"]["status"] == "received"


def test_a_statement_timeout_is_raised_after_one_try_not_retried(db):
    pool = ProcessPool(Settings(database_url=db), name="timeout", statement_timeout_ms=TIMEOUT_MS)
    run_statement(pool, "SELECT 1")  # the pool is open and its connection made
    started = time.monotonic()
    with pytest.raises(psycopg.errors.QueryCanceled):
        run_statement(pool, "SELECT pg_sleep(10)")
    elapsed = time.monotonic() - started
    pool.close()
    assert TIMEOUT_MS / 1000 <= elapsed < 1.8 * TIMEOUT_MS / 1000, elapsed


def test_the_receiver_gives_up_on_a_statement_timeout_after_one_timeout_not_two(db):
    evt = incoming(event("test.effect", {"id": "obj_t"}, created=int(time.time())))
    pool = ProcessPool(Settings(database_url=db), name="ingest", statement_timeout_ms=TIMEOUT_MS)
    store = EventStore(pool)
    store.ping()
    with psycopg.connect(db) as blocker:
        # An uncommitted insert of the same id: the receiver's insert waits on it until its timeout.
        blocker.execute(SQL.event_record_delivery, dataclasses.asdict(evt))
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable, match="QueryCanceled"):
            store.record_delivery(evt)
        elapsed = time.monotonic() - started
        blocker.rollback()
    pool.close()
    assert TIMEOUT_MS / 1000 <= elapsed < 1.8 * TIMEOUT_MS / 1000, elapsed
