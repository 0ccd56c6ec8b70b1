"""The recovery sweep in-process: re-drives lost wake-ups, never floods, and several sweepers never pick the
same event. ``ledgerctl sweep`` with a real worker is in tests/e2e/test_ledgerctl_with_workers.py."""
from __future__ import annotations

import dataclasses
import threading

from devkit.procs import run_together
from ledger.attempts import WorkerLedger
from tests.support.workers import RecordingWaker
from workers.app import make_celery
from workers.sweep import Sweeper
from workers.wakeup import Waker

BULK = 2000


def bulk_received(kit, n: int = BULK, *, wakeup_age_s: float = 0.0, prefix: str = "evt_bulk_") -> list[str]:
    """n received events whose last wake-up was due wakeup_age_s ago (set up in one statement)."""
    kit.execute("""
        INSERT INTO ledger.events (id, type, stripe_created, livemode, payload, wakeup_at)
        SELECT id, 'test.effect', now(), false,
               json_build_object('id', id, 'object', 'event', 'type', 'test.effect', 'created', 0,
                                 'livemode', false, 'data', json_build_object('object', json_build_object('id', 'o'))),
               now() - make_interval(secs => %(age)s)
          FROM (SELECT %(prefix)s || lpad(g::text, 6, '0') AS id FROM generate_series(1, %(n)s) g) ids
    """, {"n": n, "age": wakeup_age_s, "prefix": prefix})
    return [f"{prefix}{g:06d}" for g in range(1, n + 1)]


def sweeper(kit, settings, waker=None, name: str = "sweep") -> Sweeper:
    return Sweeper(WorkerLedger(kit.pool(name)), waker or RecordingWaker(), make_celery(settings), settings)


def test_one_pass_redrives_nothing_while_every_wakeup_is_recent(kit, settings):
    bulk_received(kit, wakeup_age_s=0)
    waker = RecordingWaker()
    result = sweeper(kit, dataclasses.replace(settings, sweep_overdue_s=15.0, sweep_batch=500), waker).run_once()
    assert result.redriven == 0 and waker.ids == []
    assert kit.query("SELECT count(*) AS n FROM ledger.events WHERE redrives > 0")[0]["n"] == 0


def test_a_pass_redrives_at_most_one_batch_and_an_immediate_second_pass_none_of_the_same(kit, settings):
    ids = set(bulk_received(kit, wakeup_age_s=3600))
    settings = dataclasses.replace(settings, sweep_overdue_s=15.0, sweep_batch=150)
    waker = RecordingWaker()
    sweep = sweeper(kit, settings, waker)

    first = sweep.run_once()
    assert first.redriven == 150 and len(waker.ids) == 150 and len(set(waker.ids)) == 150
    first_ids = set(waker.ids)
    assert first_ids <= ids
    picked = kit.query("SELECT redrives, wakeup_at > now() - interval '1 minute' AS recent FROM ledger.events "
                       "WHERE id = ANY(%s)", (list(first_ids),))
    assert all(r["redrives"] == 1 and r["recent"] for r in picked)

    second = sweep.run_once()
    second_ids = set(waker.ids[150:])
    assert second.redriven == 150 and len(second_ids) == 150
    assert not first_ids & second_ids
    # Oldest wake-up first: the overdue ones go before anything picked a moment ago.
    assert kit.query("SELECT count(*) AS n FROM ledger.events WHERE redrives > 1")[0]["n"] == 0


def test_the_wait_before_a_redrive_doubles_with_each_redrive(kit, settings):
    # overdue_s = 10: the n-th re-drive waits 10 * 2^n s (at most 2^6), measured from the last wake-up.
    cases = {  # id suffix: (seconds since the last wake-up, re-drives so far, picked?)
        "a": (15, 0, True), "b": (15, 1, False), "c": (25, 1, True), "d": (35, 2, False),
        "e": (45, 2, True), "f": (600, 6, False), "g": (650, 6, True), "h": (650, 30, True),
    }
    for suffix, (age, redrives, _) in cases.items():
        [evt_id] = bulk_received(kit, 1, prefix=f"evt_backoff_{suffix}_")
        kit.execute("UPDATE ledger.events SET wakeup_at = now() - make_interval(secs => %s), redrives = %s "
                    "WHERE id = %s", (age, redrives, evt_id))
    picked = kit.ledger().take_overdue_wakeups(overdue_s=10, batch=100)
    assert sorted(p.split("_")[2] for p in picked) == sorted(s for s, (_, _, want) in cases.items() if want)


def test_only_events_that_could_run_now_are_redriven(kit, settings):
    ids = dict(zip(["received", "live_lease", "expired_lease", "not_due", "due", "processed", "permanent"],
                   bulk_received(kit, 7, wakeup_age_s=3600)))
    for statement in (
        "UPDATE ledger.events SET status = 'processing', lease_owner = 'x', "
        "lease_expires_at = now() + interval '1 h' WHERE id = %(live_lease)s",
        "UPDATE ledger.events SET status = 'processing', lease_owner = 'x', "
        "lease_expires_at = now() - interval '1 s' WHERE id = %(expired_lease)s",
        "UPDATE ledger.events SET status = 'failed_recoverable', failure_reason = 'transient', "
        "next_attempt_at = now() + interval '1 h' WHERE id = %(not_due)s",
        "UPDATE ledger.events SET status = 'failed_recoverable', failure_reason = 'transient', "
        "next_attempt_at = now() - interval '1 s' WHERE id = %(due)s",
        "UPDATE ledger.events SET status = 'processed', processed_at = now() WHERE id = %(processed)s",
        "UPDATE ledger.events SET status = 'failed_permanent', failure_reason = 'unsupported_type' "
        "WHERE id = %(permanent)s",
    ):
        kit.execute(statement, ids)
    picked = kit.ledger().take_overdue_wakeups(overdue_s=1, batch=100)
    assert sorted(picked) == sorted([ids["received"], ids["expired_lease"], ids["due"]])


def test_a_pass_is_skipped_while_the_broker_queue_already_holds_a_batch(kit, broker_settings):
    settings = dataclasses.replace(broker_settings, sweep_overdue_s=15.0, sweep_batch=20)
    bulk_received(kit, 100, wakeup_age_s=3600)
    real = Waker(make_celery(settings))
    for _ in range(19):
        assert real.wake("evt_queued_already")
    waker = RecordingWaker()
    sweep = sweeper(kit, settings, waker)

    below = sweep.run_once()
    assert (below.skipped_backlog, below.queue_depth, below.redriven) == (False, 19, 20)

    assert real.wake("evt_queued_already")
    at_batch = sweep.run_once()
    assert (at_batch.skipped_backlog, at_batch.queue_depth, at_batch.redriven) == (True, 20, 0)
    assert len(waker.ids) == 20  # nothing more was picked
    assert kit.query("SELECT count(*) AS n FROM ledger.events WHERE redrives > 0")[0]["n"] == 20


def test_a_pass_over_an_empty_undeclared_queue_is_not_skipped(kit, broker_settings):
    settings = dataclasses.replace(broker_settings, sweep_overdue_s=15.0, sweep_batch=20)
    bulk_received(kit, 5, wakeup_age_s=3600)
    result = sweeper(kit, settings).run_once()
    assert (result.skipped_backlog, result.queue_depth, result.redriven) == (False, 0, 5)


def test_two_sweepers_running_at_once_never_pick_the_same_event(kit, settings):
    ids = set(bulk_received(kit, wakeup_age_s=3600))
    barrier = threading.Barrier(2)
    picked: dict[str, list[str]] = {"one": [], "two": []}
    errors: list[BaseException] = []

    def run(name: str):
        ledger = WorkerLedger(kit.pool(f"sweeper-{name}"))
        try:
            barrier.wait(timeout=30)
            while batch := ledger.take_overdue_wakeups(overdue_s=60, batch=120):
                picked[name].extend(batch)
        except BaseException as exc:
            errors.append(exc)

    names = list(picked)
    run_together(lambda i: run(names[i]), len(names))
    assert not errors, errors
    union = picked["one"] + picked["two"]
    assert len(union) == len(set(union)), "an event was picked by both sweepers"
    assert set(union) == ids
    assert kit.query("SELECT count(*) AS n FROM ledger.events WHERE redrives <> 1")[0]["n"] == 0


def test_a_sweep_skips_rows_another_sweeper_holds_instead_of_waiting_for_them(kit, settings):
    bulk_received(kit, 300, wakeup_age_s=3600)
    ledger = kit.ledger("second-sweeper")
    result: dict = {}
    with kit.connect() as first_sweeper:
        with first_sweeper.transaction():
            held = {r[0] for r in first_sweeper.execute(
                "SELECT id FROM ledger.events ORDER BY wakeup_at, id LIMIT 100 FOR UPDATE").fetchall()}
            second = threading.Thread(target=lambda: result.setdefault(
                "picked", ledger.take_overdue_wakeups(overdue_s=60, batch=150)))
            second.start()
            second.join(15)
            blocked = second.is_alive()
        second.join(30)
    assert not blocked, "the second sweeper waited on rows the first one holds"
    assert len(result["picked"]) == 150
    assert not held & set(result["picked"])
