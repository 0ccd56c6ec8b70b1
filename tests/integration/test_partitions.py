"""The ledger's time partitions on real Postgres (migration 0012, ledger/partitions.py): a new ledger is
partitioned by month of Stripe's `created`, the months ahead are made by the sweep's upkeep, and an event id
is a duplicate whichever partition, month or delivery brings it again (docs/guarantee.md, "Dedupe across
partitions")."""
from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timezone

import psycopg

from devkit.factories import event
from ledger.migrate import migrate
from ledger.partitions import AHEAD, PartitionHealth, Partitions
from workers.processor import Outcome

DAY = 86400


def _month_start(ts: float) -> datetime:
    d = datetime.fromtimestamp(ts, tz=timezone.utc)
    return datetime(d.year, d.month, 1, tzinfo=timezone.utc)


def _partition_of(kit, event_id: str) -> str:
    return kit.query("SELECT tableoid::regclass::text AS p FROM ledger.events WHERE id = %s", (event_id,))[0]["p"]


def test_a_new_ledger_is_partitioned_by_month_of_stripe_created(kit):
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


def test_a_redelivery_months_later_is_a_duplicate_and_changes_nothing(kit):
    """The first delivery in one month, processed; Stripe (or a catch-up) brings it again weeks later, after the
    upkeep made new months, once with its own `created` and once with another (an altered copy): neither is a
    second event, a second attempt or a second effect."""
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


def test_the_upkeep_makes_the_months_ahead_once_however_many_sweeps_run_it(kit):
    upkeep = Partitions(kit.pool())
    ahead = upkeep.health().months_ahead
    assert ahead >= AHEAD
    made = upkeep.ensure(ahead + 2)
    assert len(made) == 2 and upkeep.ensure(ahead + 2) == []
    assert upkeep.health().months_ahead == ahead + 2


def test_two_sweeps_making_the_same_months_at_once_make_each_once(kit):
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
    ledger stays a plain table until the online migration, and the receiver, the workers and the upkeep
    work on it as they did."""
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
    assert [m.version for m in migrate(fresh_db)] == [12]

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
