"""Catch-up in-process against the fake Stripe API and a real Postgres: what is recorded and in which order,
the dedupe with webhook deliveries, the cursor (same-second events, a failure mid-run, the 30-day edge),
the gap report, dry runs, the per-account lock, filters, connected accounts, the periodic mode.
``ledgerctl catchup`` with real workers and two runs at once: tests/e2e/test_catchup_e2e.py."""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from prometheus_client import REGISTRY

from devkit.factories import event, incoming
from ledger.errors import DatabaseUnavailable
from ledger.deliveries import EventStore
from tests.support.stripe_api import api_settings, env_of, fake_stripe  # noqa: F401
from tests.support.workers import RecordingWaker
from workers.catchup import CatchUp, CatchupBusy, CatchupRequest, PeriodicCatchup
from workers.stripe_api import RetryRule, StripeApi

NOW = int(time.time())
DAY = 86400


def effect(n: int, created: int, **kw) -> dict:
    return event("test.effect", {"id": f"obj_{n}"}, created=created, event_id=f"evt_{n:04d}", **kw)


def catchup(kit, settings, fake, *, waker=None, store=None) -> CatchUp:
    settings = api_settings(settings, fake)
    return CatchUp(settings, kit.pool("catchup"), StripeApi(settings, rule=RetryRule(base_s=0.01)),
                   waker if waker is not None else RecordingWaker(), store=store)


def deliveries(kit) -> list[tuple[str, str]]:
    return [(r["event_id"], r["source"]) for r in
            kit.query("SELECT event_id, source FROM ledger.deliveries ORDER BY event_id, source")]


def cursor(kit, account: str = "") -> dict | None:
    rows = kit.query("SELECT * FROM ledger.catchup_cursors WHERE account = %s", (account,))
    return rows[0] if rows else None


def missed_metric(type_: str) -> float:
    return REGISTRY.get_sample_value("catchup_missed_events_total", {"type": type_}) or 0.0


def test_missed_events_are_recorded_oldest_first_as_catchup_deliveries_and_woken(kit, settings, fake_stripe):
    events = [effect(n, NOW - 3600 + n * 60) for n in range(6)]
    fake_stripe.add_events(events)
    for delivered in (events[1], events[4]):  # the webhook got these two
        kit.record(delivered)
    waker = RecordingWaker()
    before = missed_metric("test.effect")

    report = catchup(kit, settings, fake_stripe, waker=waker).run(CatchupRequest(since=datetime.fromtimestamp(
        NOW - 7200, timezone.utc)))

    assert (report.listed, report.recorded, report.missed, report.duplicates) == (6, 6, 4, 2)
    assert report.missed_by_type == {"test.effect": 4}
    assert missed_metric("test.effect") - before == 4
    # One ledger row per event; the two delivered ones also got a catch-up delivery, as a redelivery would.
    assert kit.query("SELECT count(*) AS n FROM ledger.events")[0]["n"] == 6
    assert deliveries(kit) == sorted([(e["id"], "catchup") for e in events]
                                     + [(events[1]["id"], "webhook"), (events[4]["id"], "webhook")])
    # Oldest first, each woken once (the webhook's two are still received: woken again, as the receiver would).
    assert waker.ids == [e["id"] for e in events]
    row = kit.event(events[0]["id"])
    assert row["status"] == "received" and row["type"] == "test.effect"
    assert row["payload"] == json.loads(json.dumps(events[0]))


def test_events_of_one_second_are_recorded_in_the_order_stripe_created_them(kit, settings, fake_stripe):
    same_second = [effect(n, NOW - 60) for n in range(5)]
    fake_stripe.add_events(same_second)  # the fake lists a second's events later-added first, as Stripe does
    waker = RecordingWaker()
    catchup(kit, settings, fake_stripe, waker=waker).run(CatchupRequest(from_cursor=True))
    assert waker.ids == [e["id"] for e in same_second]


def test_from_the_cursor_a_second_run_records_only_what_is_new_including_the_cursors_own_second(
        kit, settings, fake_stripe):
    first = [effect(n, NOW - 600 + n) for n in range(4)]
    fake_stripe.add_events(first)
    run = catchup(kit, settings, fake_stripe)
    report = run.run(CatchupRequest(from_cursor=True))
    assert report.recorded == 4 and report.listed_from is None  # no cursor yet: the whole window
    assert (cursor(kit)["last_event_id"], cursor(kit)["last_found"]) == (first[-1]["id"], 4)

    # Later: one more event of the cursor's own second, listed after the cursor was written, and newer ones.
    late_same_second = effect(10, first[-1]["created"])
    newer = [effect(11, NOW - 100), effect(12, NOW - 50)]
    fake_stripe.add_events([late_same_second, *newer])
    report = run.run(CatchupRequest(from_cursor=True))

    assert report.listed == 7 and report.skipped == 4 and report.recorded == 3 and report.missed == 3
    # Listed from 5 minutes before the cursor (the overlap), not from the cursor's second on.
    assert report.listed_from == datetime.fromtimestamp(first[-1]["created"], timezone.utc) - timedelta(minutes=5)
    # Nothing recorded twice: one catch-up delivery per event.
    assert deliveries(kit) == sorted((e["id"], "catchup") for e in [*first, late_same_second, *newer])
    assert cursor(kit)["last_event_id"] == newer[-1]["id"]

    # Nothing new: a third run records nothing.
    again = run.run(CatchupRequest(from_cursor=True))
    assert (again.recorded, again.missed) == (0, 0) and len(deliveries(kit)) == 7


class FailingStore(EventStore):
    """The receiver's store, whose database goes away at the ``fail_at``-th delivery."""

    def __init__(self, pool, fail_at: int):
        super().__init__(pool)
        self.calls = 0
        self.fail_at = fail_at

    def record_delivery(self, event):
        self.calls += 1
        if self.calls == self.fail_at:
            raise DatabaseUnavailable("Postgres unavailable: OperationalError")
        return super().record_delivery(event)


def test_the_cursor_moves_only_over_committed_events_so_a_failed_run_resumes_where_it_stopped(
        kit, settings, fake_stripe):
    events = [effect(n, NOW - 1000 + n * 10) for n in range(6)]
    fake_stripe.add_events(events)
    failing = FailingStore(kit.pool("receiver"), fail_at=4)
    with pytest.raises(DatabaseUnavailable):
        catchup(kit, settings, fake_stripe, store=failing).run(CatchupRequest(from_cursor=True))
    assert cursor(kit)["last_event_id"] == events[2]["id"]  # the third committed; the fourth did not
    assert kit.query("SELECT count(*) AS n FROM ledger.events")[0]["n"] == 3

    waker = RecordingWaker()
    report = catchup(kit, settings, fake_stripe, waker=waker).run(CatchupRequest(from_cursor=True))
    assert report.recorded == 3 and report.skipped == 3 and waker.ids == [e["id"] for e in events[3:]]
    assert deliveries(kit) == sorted((e["id"], "catchup") for e in events)


def test_a_cursor_past_the_30_day_window_is_an_unrecoverable_gap_naming_the_repair(kit, settings, fake_stripe):
    old = effect(1, NOW - 31 * DAY)
    fake_stripe.add_event(old)
    fake_stripe.set_now(NOW - 30 * DAY)  # a catch-up a month ago, when the event was a day old
    run = catchup(kit, settings, fake_stripe)
    run.run(CatchupRequest(from_cursor=True))
    assert cursor(kit)["last_event_id"] == old["id"]

    # Today: Stripe no longer lists the cursor's event; a newer one it does.
    fake_stripe.set_now(None)
    recent = effect(2, NOW - 3600)
    fake_stripe.add_event(recent)
    report = run.run(CatchupRequest(from_cursor=True))

    assert report.gap is not None and report.gap.after == datetime.fromtimestamp(old["created"], timezone.utc)
    assert report.gap.repair == "ledgerctl backfill all"
    assert "unrecoverable gap" in report.gap.message() and "ledgerctl backfill all" in report.gap.message()
    assert report.recorded == 1 and cursor(kit)["last_event_id"] == recent["id"]  # what is listable is caught up


def test_ledgerctl_catchup_reports_a_gap_with_exit_status_3(kit, settings, fake_stripe, ledgerctl_cli):
    fake_stripe.add_event(effect(1, NOW - 3600))
    result = ledgerctl_cli("catchup", "--since", "40d", "--account", "acct_1gap", code=3, env=env_of(fake_stripe))
    assert "unrecoverable gap" in result.stderr
    assert "ledgerctl backfill all --account acct_1gap" in result.stderr


def test_a_start_inside_the_window_is_no_gap_and_one_before_it_is(kit, settings, fake_stripe):
    run = catchup(kit, settings, fake_stripe)
    now = datetime.now(timezone.utc)
    inside = run.run(CatchupRequest(since=now - timedelta(days=30) + timedelta(minutes=1)))
    at_the_edge = run.run(CatchupRequest(since=now - timedelta(days=30) - timedelta(seconds=30)))
    before = run.run(CatchupRequest(since=now - timedelta(days=30) - timedelta(minutes=2)))
    assert (inside.gap, at_the_edge.gap) == (None, None) and before.gap is not None
    assert at_the_edge.listed_from is None and before.listed_from is None  # both list the whole window


def test_a_dry_run_writes_nothing(kit, settings, fake_stripe, ledgerctl_cli):
    events = [effect(n, NOW - 600 + n) for n in range(3)]
    fake_stripe.add_events(events)
    kit.record(events[0])
    before = kit.query("SELECT (SELECT count(*) FROM ledger.events) AS events, "
                       "(SELECT count(*) FROM ledger.deliveries) AS deliveries, "
                       "(SELECT count(*) FROM ledger.catchup_cursors) AS cursors")[0]

    result = ledgerctl_cli("catchup", "--dry-run", "--json", env=env_of(fake_stripe))

    report = json.loads(result.stdout)
    assert (report["listed"], report["missed"], report["duplicates"], report["dry_run"]) == (3, 2, 1, True)
    assert kit.query("SELECT (SELECT count(*) FROM ledger.events) AS events, "
                     "(SELECT count(*) FROM ledger.deliveries) AS deliveries, "
                     "(SELECT count(*) FROM ledger.catchup_cursors) AS cursors")[0] == before


def test_a_second_catchup_of_the_same_account_is_refused_while_the_first_holds_the_lock(
        kit, settings, fake_stripe, ledgerctl_cli):
    fake_stripe.add_event(effect(1, NOW - 60))
    with psycopg.connect(settings.database_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtextextended('ledger.catchup:' || '', 0))")
        with pytest.raises(CatchupBusy, match="another catch-up of the platform is running"):
            catchup(kit, settings, fake_stripe).run(CatchupRequest(from_cursor=True))
        result = ledgerctl_cli("catchup", code=4, env=env_of(fake_stripe))
        assert "another catch-up of the platform is running" in result.stderr
        # Another account is not held up.
        catchup(kit, settings, fake_stripe).run(CatchupRequest(account="acct_other", from_cursor=True))
    assert kit.query("SELECT count(*) AS n FROM ledger.events")[0]["n"] == 0
    report = catchup(kit, settings, fake_stripe).run(CatchupRequest(from_cursor=True))
    assert report.recorded == 1


def test_the_lock_connection_is_idle_outside_any_transaction_while_stripe_is_called(kit, settings, fake_stripe):
    fake_stripe.add_event(effect(1, NOW - 60))
    fake_stripe.slow_next(1, seconds=1.0, path_prefix="/v1/events")
    run = catchup(kit, settings, fake_stripe)
    thread = threading.Thread(target=run.run, args=(CatchupRequest(from_cursor=True),))
    thread.start()
    try:
        time.sleep(0.5)  # the listing is being answered, slowly
        states = kit.query("SELECT state, xact_start FROM pg_stat_activity "
                           "WHERE application_name = 'ledger-catchup' AND pid <> pg_backend_pid()")
        assert states and all(s["state"] == "idle" and s["xact_start"] is None for s in states), states
    finally:
        thread.join()


def test_filtered_runs_leave_the_cursor_alone_and_undelivered_selects_failed_deliveries(
        kit, settings, fake_stripe, ledgerctl_cli):
    ok = effect(1, NOW - 300)
    failed = effect(2, NOW - 200)
    other = event("invoice.upcoming", {"id": "in_1", "object": "invoice"}, created=NOW - 100, event_id="evt_up")
    fake_stripe.add_events([ok, other])
    fake_stripe.add_event(failed, delivered=False)
    run = catchup(kit, settings, fake_stripe)

    report = run.run(CatchupRequest(undelivered=True))
    assert report.recorded == 1 and kit.query("SELECT id FROM ledger.events") == [{"id": failed["id"]}]
    report = run.run(CatchupRequest(types=("invoice.upcoming",)))
    assert report.recorded == 1 and report.cursor is None
    assert cursor(kit) is None
    usage = ledgerctl_cli("catchup", "--from-cursor", "--types", "invoice.upcoming", code=2, env=env_of(fake_stripe))
    assert "cannot be combined" in usage.output


def test_a_connected_accounts_events_are_recorded_as_its_own_with_a_cursor_of_its_own(kit, settings, fake_stripe):
    platform = effect(1, NOW - 300)
    connected = effect(2, NOW - 200)
    fake_stripe.add_event(platform)
    fake_stripe.add_event(connected, account="acct_1conn")
    report = catchup(kit, settings, fake_stripe).run(CatchupRequest(account="acct_1conn", from_cursor=True))
    assert report.recorded == 1
    assert kit.query("SELECT id, account FROM ledger.events") == [{"id": connected["id"], "account": "acct_1conn"}]
    assert cursor(kit, "acct_1conn")["last_event_id"] == connected["id"] and cursor(kit) is None
    assert [r.account for r in fake_stripe.requests if r.path.startswith("/v1/events")] == ["acct_1conn"]


def test_the_periodic_catchup_covers_the_platform_and_every_account_with_a_cursor(kit, settings, fake_stripe):
    kit.execute("INSERT INTO ledger.catchup_cursors (account) VALUES ('acct_1a'), ('acct_1b')")
    fake_stripe.add_event(effect(1, NOW - 60))
    fake_stripe.add_event(effect(2, NOW - 60), account="acct_1a")
    fake_stripe.add_event(effect(3, NOW - 60), account="acct_1b")
    fake_stripe.add_event(effect(4, NOW - 60), account="acct_1never")  # no cursor: not covered
    periodic = PeriodicCatchup(api_settings(settings, fake_stripe), RecordingWaker(), interval_s=60)
    try:
        reports = periodic.run_once()
    finally:
        periodic.close()
    assert [r.account for r in reports] == [None, "acct_1a", "acct_1b"]
    assert {(r["id"], r["account"]) for r in kit.query("SELECT id, account FROM ledger.events")} == {
        ("evt_0001", None), ("evt_0002", "acct_1a"), ("evt_0003", "acct_1b")}


def test_the_sweep_loop_runs_the_periodic_catchup_when_an_interval_is_set(kit, settings, fake_stripe):
    from ledger.attempts import WorkerLedger
    from workers.app import make_celery
    from workers.sweep import Sweeper

    fake_stripe.add_event(effect(1, NOW - 60))
    on = dataclasses.replace(api_settings(settings, fake_stripe), catchup_interval_s=0.2, sweep_interval_s=0.1)
    Sweeper(WorkerLedger(kit.pool("sweep")), RecordingWaker(), make_celery(on), on).run_forever(stop_after=1.0)
    assert [r["id"] for r in kit.query("SELECT id FROM ledger.events")] == ["evt_0001"]
    assert len([r for r in fake_stripe.requests if r.path == "/v1/events"]) >= 2  # every interval

    kit.wipe()
    fake_stripe.clear_requests()
    off = dataclasses.replace(on, catchup_interval_s=0)
    Sweeper(WorkerLedger(kit.pool("sweep")), RecordingWaker(), make_celery(off), off).run_forever(stop_after=0.3)
    assert fake_stripe.requests == [] and kit.query("SELECT id FROM ledger.events") == []


def test_events_of_a_mode_the_deployment_refuses_are_not_recorded_as_the_receiver_refuses_them(
        kit, settings, fake_stripe):
    live, test = effect(1, NOW - 600, livemode=True), effect(2, NOW - 300, livemode=False)
    fake_stripe.add_events([live, test])
    settings = dataclasses.replace(settings, accept_livemode="test")

    report = catchup(kit, settings, fake_stripe).run(CatchupRequest(since=datetime.fromtimestamp(
        NOW - 3600, timezone.utc)))

    assert (report.listed, report.recorded, report.refused_mode) == (2, 1, 1)
    assert [r["id"] for r in kit.query("SELECT id FROM ledger.events")] == [test["id"]]
