"""The ledger's time partitions on real Postgres (migration 0012, ledger/partitions.py,
ledger/partition_migration.py): a partitioned ledger by month of Stripe's `created`, the months ahead made by
the sweep's upkeep, an event id a duplicate whichever partition, month or delivery brings it again
(docs/guarantee.md, "Dedupe across partitions"), and the migration that partitions a ledger."""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from datetime import datetime, timezone

import psycopg
import pytest

from devkit.factories import event
from ledger.errors import MigrationError
from ledger.migrate import migrate
from ledger.partitions import AHEAD, PartitionHealth, Partitions
from workers.processor import Outcome

DAY = 86400


def _month_start(ts: float) -> datetime:
    d = datetime.fromtimestamp(ts, tz=timezone.utc)
    return datetime(d.year, d.month, 1, tzinfo=timezone.utc)


def _partition_of(kit, event_id: str) -> str:
    return kit.query("SELECT tableoid::regclass::text AS p FROM ledger.events WHERE id = %s", (event_id,))[0]["p"]


def test_a_partitioned_ledger_is_partitioned_by_month_of_stripe_created(partitioned_kit):
    kit = partitioned_kit
    kinds = {r["relname"]: r["relkind"] for r in kit.query(
        "SELECT relname, relkind FROM pg_class WHERE relnamespace = 'ledger'::regnamespace "
        "AND relname IN ('events', 'deliveries', 'attempts', 'outbox', 'audit')")}
    assert kinds == {"events": "p", "deliveries": "p", "attempts": "p", "outbox": "r", "audit": "r"}
    listed = Partitions(kit.pool()).listed()
    assert listed[-1]["is_default"] and listed[-1]["name"] == "events_default"
    months = [p["starts"] for p in listed if not p["is_default"]]
    now = time.time()
    # From the month 31 days back (the oldest a catch-up may bring) to three after this one.
    assert months[0] <= _month_start(now - 31 * DAY) and months[-1] >= _month_start(now + 80 * DAY)

    this_month = kit.record(event("test.effect", {"id": "obj_now"}, created=int(now)))
    stray = kit.record(event("test.effect", {"id": "obj_2019"}, created=1_550_000_000))
    assert _partition_of(kit, this_month) == f"ledger.events_{_month_start(now):%Y_%m}"
    assert _partition_of(kit, stray) == "ledger.events_default"
    assert Partitions(kit.pool()).health().strays == 1


def test_a_redelivery_months_later_is_a_duplicate_and_changes_nothing(partitioned_kit):
    """The first delivery in one month, processed; Stripe (or a catch-up) brings it again weeks later, after the
    upkeep made new months, once with its own `created` and once with another (an altered copy): neither is a
    second event, a second attempt or a second effect."""
    kit = partitioned_kit
    created = int(time.time()) - 20 * DAY
    first = event("test.effect", {"id": "obj_once"}, created=created)
    evt_id = kit.record(first)
    assert kit.processor().process(evt_id) is Outcome.PROCESSED
    assert kit.effects(evt_id) == 1
    kit.execute("UPDATE ledger.events SET received_at = received_at - interval '40 days' WHERE id = %s", (evt_id,))
    assert Partitions(kit.pool()).ensure(AHEAD + 2)  # months made since the first delivery
    home = _partition_of(kit, evt_id)

    kit.record(first)
    kit.record({**first, "created": created + 45 * DAY})

    rows = kit.query("SELECT id, status, attempts, tableoid::regclass::text AS p FROM ledger.events")
    assert rows == [{"id": evt_id, "status": "processed", "attempts": 1, "p": home}]
    assert kit.deliveries(evt_id) == 3  # both copies recorded as deliveries of the one event
    assert kit.processor().process(evt_id) is Outcome.NOT_CLAIMED
    assert kit.effects(evt_id) == 1


def test_the_upkeep_makes_the_months_ahead_once_however_many_sweeps_run_it(partitioned_kit):
    kit = partitioned_kit
    upkeep = Partitions(kit.pool())
    ahead = upkeep.health().months_ahead
    assert ahead >= AHEAD
    made = upkeep.ensure(ahead + 2)
    assert len(made) == 2 and upkeep.ensure(ahead + 2) == []
    assert upkeep.health().months_ahead == ahead + 2


def test_two_sweeps_making_the_same_months_at_once_make_each_once(partitioned_kit):
    kit = partitioned_kit
    upkeep = [Partitions(kit.pool(f"sweep{n}")) for n in range(2)]
    ahead = upkeep[0].health().months_ahead
    results, errors = [], []
    barrier = threading.Barrier(2)

    def run(p: Partitions):
        barrier.wait()
        try:
            results.append(p.ensure(ahead + 2))
        except Exception as exc:  # pragma: no cover - what the test is for
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(p,)) for p in upkeep]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and sorted(map(len, results)) == [0, 2]


def test_a_ledger_that_had_events_keeps_its_shape_and_keeps_working(fresh_db, settings):
    """Migration 0012 on a ledger with events adds columns only (no rewrite, no lock held for a copy): the
    ledger stays a plain table until an operator partitions it, and the receiver, the workers and the
    upkeep work on it as they did."""
    from dataclasses import replace as replace_settings

    from tests.integration.test_migration_stripe_api import migrate_to
    from tests.support.handlers_for_tests import ensure_test_tables
    from tests.support.workers import LedgerKit

    migrate_to(fresh_db, 11)
    old = event("test.effect", {"id": "obj_before"}, created=int(time.time()) - 3 * DAY)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO ledger.events (id, type, stripe_created, livemode, payload) "
                     "VALUES (%s, %s, to_timestamp(%s), false, %s::json)",
                     (old["id"], old["type"], old["created"], json.dumps(old)))
        conn.execute("INSERT INTO ledger.deliveries (event_id) VALUES (%s)", (old["id"],))
        ensure_test_tables(conn)
    assert [m.version for m in migrate(fresh_db)][0] == 12

    kit = LedgerKit(replace_settings(settings, database_url=fresh_db))
    try:
        assert Partitions(kit.pool()).health() == PartitionHealth(partitioned=False, months_ahead=0, strays=0)
        assert Partitions(kit.pool()).ensure() == []
        new = kit.record(event("test.effect", {"id": "obj_after"}, created=int(time.time())))
        kit.record(old)
        for evt_id in (old["id"], new):
            assert kit.processor().process(evt_id) is Outcome.PROCESSED
        kit.record(old)
        assert kit.effects(old["id"]) == kit.effects(new) == 1
        assert kit.deliveries(old["id"]) == 3
    finally:
        kit.close()


def _old_ledger(fresh_db: str, events: int = 300) -> None:
    """A ledger of the release before partitions with ``events`` processed events (a delivery and an attempt
    each), then migration 0012 (columns only)."""
    migrate(fresh_db, upto=11)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute(f"""
            INSERT INTO ledger.events (id, type, status, attempts, stripe_created, livemode, payload, processed_at)
            SELECT 'evt_old' || g, 'test.effect', 'processed', 1, now() - g * interval '3 days', false,
                   json_build_object('n', g), now()
              FROM generate_series(1, {events}) g""")
        conn.execute("INSERT INTO ledger.deliveries (event_id, delivered_at) "
                     "SELECT id, now() - interval '1 hour' FROM ledger.events")
        conn.execute("INSERT INTO ledger.attempts (event_id, attempt, worker, lease_owner, finished_at, outcome) "
                     "SELECT id, 1, 'w', 'w', now(), 'processed' FROM ledger.events")
    migrate(fresh_db)


def _pool(settings, url):
    from ledger.db import ProcessPool

    return ProcessPool(dataclasses.replace(settings, database_url=url), name="partition-migration-test")


def test_an_interrupted_migration_resumes_where_it_stood_and_runs_once_at_a_time(fresh_db, settings):
    from ledger.partition_migration import AnotherMigration, PartitionMigration
    from ledger.statements import run_statement

    _old_ledger(fresh_db)
    pool = _pool(settings, fresh_db)
    try:
        # Stopped after its triggers were made (the twins half empty): run again, it resumes.
        run_statement(pool, "SELECT ledger.partition_migration_twins(ARRAY[date_trunc('month', now())::date])")
        run_statement(pool, "SELECT ledger.partition_migration_mirror()")
        run_statement(pool, "INSERT INTO ledger.events_partitioned SELECT * FROM ledger.events LIMIT 10")
        migration = PartitionMigration(pool, batch=50)
        assert migration.state()["phase"] == "mirroring"
        with psycopg.connect(fresh_db, autocommit=True) as other:
            other.execute("SELECT pg_advisory_lock(hashtextextended('ledger.partition_migration', 0))")
            with pytest.raises(AnotherMigration):
                migration.run()
        report = migration.run()
        assert (report.status, report.events, report.attempts, report.deliveries) == ("done", 300, 300, 300)
        with psycopg.connect(fresh_db) as conn:
            assert conn.execute("SELECT ledger.is_partitioned()").fetchone()[0]
            # The one month made here (the interrupted run's), and the default partition for the others.
            assert conn.execute("SELECT count(*), count(DISTINCT tableoid) FROM ledger.events").fetchone() == (300, 2)
            assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = 'partition_mirror'").fetchone()[0] == 0
        assert migration.run().status == "already"
        with pytest.raises(MigrationError, match="nothing to abort"):
            migration.abort()
    finally:
        pool.close()


def test_a_migration_given_up_before_its_swap_leaves_the_tables_as_they_were(fresh_db, settings):
    from ledger.partition_migration import PartitionMigration
    from ledger.statements import run_statement

    _old_ledger(fresh_db, events=50)
    pool = _pool(settings, fresh_db)
    try:
        run_statement(pool, "SELECT ledger.partition_migration_twins(ARRAY[date_trunc('month', now())::date])")
        run_statement(pool, "SELECT ledger.partition_migration_mirror()")
        assert PartitionMigration(pool).abort().status == "aborted"
        with psycopg.connect(fresh_db) as conn:
            assert not conn.execute("SELECT ledger.is_partitioned()").fetchone()[0]
            assert conn.execute("SELECT count(*) FROM pg_class WHERE relname LIKE '%\\_partitioned'").fetchone()[0] == 0
            assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = 'partition_mirror'").fetchone()[0] == 0
            assert conn.execute("SELECT count(*) FROM ledger.events").fetchone()[0] == 50
        assert PartitionMigration(pool).run().status == "done"
    finally:
        pool.close()


def test_a_backfill_batch_gives_way_to_a_writer_it_would_deadlock_with(fresh_db, settings):
    """A worker's claim updates several events in one transaction, in no particular order, and each update's
    mirror trigger copies its event into the twin. The backfill's batch copies the same events by id. The
    batch meets an event the claim copied first (and waits for it), the claim then meets one the batch
    copied (and waits for the batch): a cycle, which Postgres breaks after deadlock_timeout (1 s) by failing
    one of the two, the claim or the migration. The batch waits BATCH_LOCK_MS at most, rolls back and runs
    again: the claim commits, never an error, and the migration ends with the claim's rows."""
    from ledger.partition_migration import PartitionMigration
    from ledger.statements import run_statement

    _old_ledger(fresh_db, events=50)
    pool = _pool(settings, fresh_db)
    outcome: dict = {}
    try:
        run_statement(pool, "SELECT ledger.partition_migration_twins(ARRAY[date_trunc('month', now())::date])")
        run_statement(pool, "SELECT ledger.partition_migration_mirror()")
        with psycopg.connect(fresh_db) as claim:
            claim.execute("UPDATE ledger.events SET attempts = attempts + 1 WHERE id = 'evt_old9'")
            migration = PartitionMigration(pool, batch=100)  # one batch: every event, 'evt_old9' the last by id
            def migrate_partitions():
                try:
                    outcome["report"] = migration.run()
                except Exception as exc:  # noqa: BLE001 - the assertion below names it
                    outcome["error"] = exc
            thread = threading.Thread(target=migrate_partitions)
            thread.start()
            deadline = time.monotonic() + 30
            with psycopg.connect(fresh_db, autocommit=True) as watch:
                # The batch has copied the events before evt_old9 and waits for the claim's copy of it.
                while not watch.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                        "AND query LIKE '%FOR KEY SHARE%'").fetchone()[0]:
                    assert time.monotonic() < deadline and thread.is_alive()
                    time.sleep(0.005)
            claim.execute("UPDATE ledger.events SET attempts = attempts + 1 WHERE id = 'evt_old1'")
            claim.commit()
            thread.join(60)
        assert "error" not in outcome, outcome["error"]
        report = outcome["report"]
        assert report.status == "done" and report.gave_way >= 1
        with psycopg.connect(fresh_db) as conn:
            assert conn.execute("SELECT count(*) FROM ledger.events WHERE id IN ('evt_old1', 'evt_old9') "
                                "AND attempts = 2").fetchone()[0] == 2
            assert conn.execute("SELECT count(*) FROM ledger.events").fetchone()[0] == 50
    finally:
        pool.close()
