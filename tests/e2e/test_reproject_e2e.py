"""ledgerctl reproject beside real worker processes: a handler bug planted in the workers, fixed, and
billing rebuilt while live events keep being processed, from before the rebuild to after its apply;
and a rebuild over events whose effects an outbox backend received, which sees no request from it.
And a repair scoped to one customer, run again and again while real workers process its events.
(In-process, the diff, undo, refusals and a killed rebuild: tests/integration/test_reproject.py.)"""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from devkit.factories import SubscriptionHistory
from devkit.procs import wait_until
from tests.support import reprojection as rp
from tests.support.effect_endpoint import SECRET
from tests.support.workers import TEST_HANDLERS, LedgerKit, run_ledgerctl
from workers.app import make_celery
from workers.wakeup import Waker


class Traffic(threading.Thread):
    """Live events, one at a time in Stripe's order, each recorded, woken and waited for until processed
    (so the workers apply them in the order the reference does), until stopped."""

    def __init__(self, kit: LedgerKit, settings, events: list[dict]):
        super().__init__(daemon=True)
        self.kit, self.settings, self.events = kit, settings, events
        self.sent: list[dict] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self):
        celery = make_celery(self.settings, publisher_only=True)
        try:
            waker = Waker(celery)
            for evt in self.events:
                if self.stop.is_set():
                    return
                self.kit.record(evt)
                waker.wake(evt["id"])
                self.kit.wait_status(evt["id"], "processed")
                self.sent.append(evt)
        except BaseException as exc:  # noqa: BLE001 - reported by the test, after join
            self.error = exc
        finally:
            celery.close()

    def finish(self) -> list[dict]:
        self.stop.set()
        self.join(timeout=60)
        if self.error is not None:
            raise self.error
        return self.sent


def process_with_workers(kit: LedgerKit, settings, events: list[dict]) -> None:
    celery = make_celery(settings, publisher_only=True)
    try:
        waker = Waker(celery)
        for evt_id in kit.record_many(events):
            waker.wake(evt_id)
    finally:
        celery.close()
    for evt in events:
        kit.wait_status(evt["id"], "processed", timeout_s=60)


def ledgerctl(settings, *args: str) -> str:
    done = run_ledgerctl(settings, "reproject", *args, timeout_s=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


reference = pytest.fixture(rp.reference_ledger)


def buggy_then_fixed(kit: LedgerKit, settings, worker_factory, history: list[dict], live: list[dict]) -> "Traffic":
    """``history`` processed by workers with the planted bug, which then stop; workers with the fixed handler
    start, and ``live`` is sent to them one event at a time (the traffic returned, started)."""
    buggy = worker_factory(settings, handler_modules=(TEST_HANDLERS, rp.MODULE), concurrency=2, label="buggy")
    process_with_workers(kit, settings, history)
    buggy.kill()
    worker_factory(settings, concurrency=2, label="fixed")
    traffic = Traffic(kit, settings, live)
    traffic.start()
    return traffic


def processed_in_order(reference: LedgerKit, events: list[dict]) -> LedgerKit:
    """The reference ledger once it has processed ``events`` with the fixed handler, in Stripe's order."""
    for evt in events:
        reference.record(evt)
    processor = reference.processor()
    for evt in sorted(events, key=lambda e: (e["created"], e["id"])):
        assert processor.process(evt["id"]).value == "processed"
    return reference


def test_billing_rebuilt_while_live_events_are_processed_equals_a_ledger_processed_by_the_fixed_handler(
        kit, broker_settings, configured_worker_factory, reference):
    settings = broker_settings
    history = rp.lifecycles(40, start=1_700_000_000)
    live = [evt for evt in rp.lifecycles(30, start=1_710_000_000, cut_at=10)]
    traffic = buggy_then_fixed(kit, settings, configured_worker_factory, history, live)
    wait_until(lambda: len(traffic.sent) >= 5, what="live events to be processed before the rebuild")
    ledgerctl(settings, "start", "--slice-size", "5")
    time.sleep(1.0)  # events processed after the rebuild was built: the apply's catch-ups bring them in
    ledgerctl(settings, "apply", "--yes")
    wait_until(lambda: len(traffic.sent) >= len(live) - 20, timeout_s=120, what="live events after the apply")
    sent = traffic.finish()

    run = kit.query("SELECT * FROM ledger.reprojections ORDER BY id DESC LIMIT 1")[0]
    processed_at = {r["id"]: r["processed_at"] for r in kit.query("SELECT id, processed_at FROM ledger.events")}
    during_build = [e for e in sent if run["started_at"] <= processed_at[e["id"]] <= run["built_at"]]
    before_apply = [e for e in sent if run["built_at"] < processed_at[e["id"]] <= run["applied_at"]]
    after_apply = [e for e in sent if processed_at[e["id"]] > run["applied_at"]]
    assert during_build and before_apply and after_apply, (len(during_build), len(before_apply), len(after_apply))

    assert rp.tables(kit.query) == rp.tables(processed_in_order(reference, history + sent).query)
    subscription_events = [e for e in history + sent if e["type"].startswith("customer.subscription.")]
    transitions = kit.query("SELECT event_id FROM billing.subscription_transitions")
    assert sorted(t["event_id"] for t in transitions) == sorted(e["id"] for e in subscription_events)


def test_a_rebuild_over_events_that_produced_effects_sends_none(kit, broker_settings, configured_worker_factory,
                                                                effect_endpoint):
    endpoint = effect_endpoint()
    settings = dataclasses.replace(broker_settings, sweep_overdue_s=0.5, outbox_webhook_url=endpoint.url,
                                   outbox_webhook_secret=SECRET, outbox_timeout_s=0.5)
    configured_worker_factory(settings, concurrency=2)
    process_with_workers(kit, settings, rp.lifecycles(10))
    wait_until(lambda: not kit.query("SELECT 1 FROM ledger.outbox WHERE status <> 'sent'")
               and kit.query("SELECT 1 FROM ledger.outbox"), what="the history's effects to be delivered")
    received = endpoint.snapshot()["calls_total"]
    assert received, "the history produced effects"
    outbox = kit.query("SELECT count(*) AS n FROM ledger.outbox")[0]["n"]

    ledgerctl(settings, "start")
    ledgerctl(settings, "apply", "--yes")
    ledgerctl(settings, "undo", "--yes")
    time.sleep(2.0)  # the workers' sweep would have re-driven any effect left undelivered by now
    assert endpoint.snapshot()["calls_total"] == received
    assert kit.query("SELECT count(*) AS n FROM ledger.outbox")[0]["n"] == outbox


def one_customers_histories(count: int, *, start: int) -> list[dict]:
    """``count`` subscription lifecycles of one customer, their clocks interleaved (each opens with the
    customer's creation again, as a redelivered object would)."""
    customer = SubscriptionHistory().customer_id
    events = []
    for n in range(count):
        events.extend(SubscriptionHistory(start=start + n, customer_id=customer).lifecycle().events)
    return sorted(events, key=lambda e: (e["created"], e["id"]))


def test_a_customers_repair_while_its_events_are_processed_loses_none_of_them(
        kit, broker_settings, configured_worker_factory, reference):
    """Real workers with the planted bug write a customer's rows wrong; fixed workers then process more of
    its events, one at a time, while `ledgerctl reproject --customer` repairs it again and again. Every
    row ends as a ledger processed from the start by the fixed handler holds it: the repairs fixed what
    the bug wrote, and lost nothing the workers applied meanwhile."""
    settings = broker_settings
    events = one_customers_histories(6, start=1_700_000_000)
    customer = events[0]["data"]["object"]["id"]
    history, live = events[:36], events[36:]  # each subscription past_due in the history, where the bug shows
    traffic = buggy_then_fixed(kit, settings, configured_worker_factory, history, live)
    for _ in range(20):
        ledgerctl(settings, "--customer", customer, "--yes")
        if not traffic.is_alive():
            break
    sent = traffic.finish()

    assert len(sent) == len(live)
    assert rp.tables(kit.query) == rp.tables(processed_in_order(reference, events).query)
    assert kit.query("SELECT count(*) AS n FROM ledger.object_repairs WHERE object_id = %s", (customer,))[0]["n"] >= 1
