"""Any delivery order of one subscription's history yields the same billing rows as the in-order one."""
from __future__ import annotations

import copy
import queue
import random

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from devkit.factories import BASIL_API, OLD_API, SubscriptionHistory
from devkit.procs import run_together
from workers.processor import Outcome

# Columns that record when a row was written, not what it says: excluded from the comparison.
SNAPSHOT = {
    "customers": ("SELECT id, email, name, deleted, livemode, metadata, source_event_id, source_event_created "
                  "FROM billing.customers ORDER BY id"),
    "subscriptions": ("SELECT id, customer_id, status, price_id, product_id, quantity, cancel_at_period_end, "
                      "current_period_start, current_period_end, trial_end, canceled_at, ended_at, features, "
                      "livemode, source_event_id, source_event_created FROM billing.subscriptions ORDER BY id"),
    "invoices": ("SELECT id, customer_id, subscription_id, status, amount_due, amount_paid, currency, period_start, "
                 "period_end, billing_reason, deleted, livemode, source_event_id, source_event_created "
                 "FROM billing.invoices ORDER BY id"),
    "checkout_sessions": ("SELECT id, customer_id, subscription_id, client_reference_id, mode, status, "
                          "payment_status, livemode, source_event_id, source_event_created "
                          "FROM billing.checkout_sessions ORDER BY id"),
    "entitlements": "SELECT customer_id, feature, source FROM billing.entitlements ORDER BY 1, 2, 3",
    # The generic mirror converges under the same guard (every object of the history is there).
    "objects": ("SELECT id, object_type, account, livemode, data, deleted, source_event_id, source_event_created "
                "FROM billing.objects ORDER BY id"),
}


def snapshot(kit) -> dict[str, list[dict]]:
    return {name: kit.query(sql) for name, sql in SNAPSHOT.items()}


def with_checkout(history: SubscriptionHistory) -> SubscriptionHistory:
    """The lifecycle plus the Checkout session that started it (it knows the customer only by id)."""
    history.lifecycle()
    checkout = history.add("checkout.session.completed", {
        "id": f"cs_test_{history.subscription_id[4:]}", "object": "checkout.session",
        "customer": history.customer_id, "subscription": history.subscription_id,
        "client_reference_id": "user-42", "mode": "subscription", "status": "complete", "payment_status": "paid"})
    # Stripe sends it right after the subscription is created.
    history.events.remove(checkout)
    checkout["created"] = history.events[1]["created"] + 1
    history.events.insert(2, checkout)
    return history


def same_second_ties(api_version: str) -> list[dict]:
    """Several events created in the same second: only the event id can order them."""
    events = copy.deepcopy(with_checkout(SubscriptionHistory(api_version=api_version)).events)
    tied = events[5]["created"]
    for evt in events[5:10]:  # payment_failed, past_due, invoice paid, active, cancel_at_period_end
        evt["created"] = tied
    events[2]["created"] = events[1]["created"]  # the checkout session ties with subscription.created
    return events


HISTORIES = {
    "old api": with_checkout(SubscriptionHistory(api_version=OLD_API)).events,
    "basil api": with_checkout(SubscriptionHistory(api_version=BASIL_API)).events,
    "old api with same-second ties": same_second_ties(OLD_API),
    "basil api with same-second ties": same_second_ties(BASIL_API),
}
N = len(HISTORIES["old api"])
assert all(len(events) == N for events in HISTORIES.values())
_in_order: dict[str, dict] = {}


def deliver(kit, processor, events: list[dict], order, replays=()) -> dict:
    kit.wipe()
    for index in order:
        evt_id = kit.record(events[index])
        assert processor.process(evt_id) is Outcome.PROCESSED, kit.event(evt_id)
    for index in replays:  # re-applied later, as after a lost ledger update or an operator replay
        kit.execute("UPDATE ledger.events SET status = 'received', processed_at = NULL WHERE id = %s",
                    (events[index]["id"],))
        assert processor.process(events[index]["id"]) is Outcome.PROCESSED
    assert kit.query("SELECT count(*) AS n FROM billing.subscription_transitions")[0]["n"] == sum(
        1 for e in events if e["type"].startswith("customer.subscription."))
    return snapshot(kit)


def in_order(kit, processor, variant: str) -> dict:
    if variant not in _in_order:
        _in_order[variant] = deliver(kit, processor, HISTORIES[variant], range(N))
    return _in_order[variant]


@pytest.mark.parametrize("variant", list(HISTORIES))
@hypothesis_settings(max_examples=25, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(order=st.permutations(range(N)), replays=st.lists(st.integers(0, N - 1), max_size=3))
def test_any_delivery_order_gives_the_rows_of_the_in_order_application(kit, variant, order, replays):
    processor = kit.__dict__.setdefault("_ordering_processor", kit.processor(modules=()))
    expected = in_order(kit, processor, variant)
    assert deliver(kit, processor, HISTORIES[variant], order, replays) == expected


@pytest.mark.parametrize("api_version", [OLD_API, BASIL_API])
def test_the_in_order_application_ends_with_the_canceled_subscription_and_paid_invoices(kit, api_version):
    history = with_checkout(SubscriptionHistory(api_version=api_version))
    rows = deliver(kit, kit.processor(modules=()), history.events, range(N))
    [sub] = rows["subscriptions"]
    assert (sub["id"], sub["status"], sub["customer_id"]) == (history.subscription_id, "canceled", history.customer_id)
    assert sub["source_event_id"] == history.events[-1]["id"]
    assert sub["current_period_start"] is not None and sub["canceled_at"] is not None
    assert [(i["status"], i["amount_paid"], i["subscription_id"]) for i in rows["invoices"]] == [
        ("paid", 1500, history.subscription_id)] * 2
    [customer] = rows["customers"]
    assert customer["email"] == f"{history.customer_id}@example.test"
    [checkout] = rows["checkout_sessions"]
    assert (checkout["customer_id"], checkout["subscription_id"], checkout["client_reference_id"]) == (
        history.customer_id, history.subscription_id, "user-42")
    assert rows["entitlements"] == []  # canceled: nothing granted any more


def test_a_stale_event_is_processed_but_not_applied_and_its_transition_says_so(kit):
    history = SubscriptionHistory(api_version=OLD_API).lifecycle()
    processor = kit.processor(modules=())
    stale = history.events[2]  # trialing -> active, delivered after everything else
    for evt in history.events:
        if evt is not stale:
            assert processor.process(kit.record(evt)) is Outcome.PROCESSED
    before = kit.query("SELECT * FROM billing.subscriptions")

    assert processor.process(kit.record(stale)) is Outcome.PROCESSED
    assert kit.status(stale["id"]) == "processed"
    assert kit.query("SELECT * FROM billing.subscriptions") == before  # updated_at included: untouched
    [transition] = kit.query("SELECT * FROM billing.subscription_transitions WHERE event_id = %s", (stale["id"],))
    assert transition["applied"] is False
    assert (transition["from_status"], transition["to_status"]) == ("canceled", "active")
    applied = kit.query("SELECT event_id FROM billing.subscription_transitions WHERE applied ORDER BY event_created")
    assert [r["event_id"] for r in applied] == [e["id"] for e in history.events
                                               if e["type"].startswith("customer.subscription.") and e is not stale]


def test_workers_applying_two_subscriptions_of_one_customer_concurrently_converge_to_the_in_order_rows(kit):
    first = with_checkout(SubscriptionHistory(api_version=BASIL_API))
    second = SubscriptionHistory(api_version=BASIL_API, customer_id=first.customer_id, start=first.start + 3,
                                 features=("exports", "reports")).lifecycle()
    events = sorted(first.events + second.events, key=lambda e: e["created"])
    processors = [kit.processor(modules=(), name=f"concurrent-{n}") for n in range(3)]
    expected = deliver(kit, processors[0], events, range(len(events)))

    for seed in range(5):
        kit.wipe()
        order = list(range(len(events)))
        random.Random(seed).shuffle(order)
        ids = kit.record_many([events[i] for i in order])
        pending = queue.SimpleQueue()
        for evt_id in ids:
            pending.put(evt_id)
        outcomes: list[Outcome] = []

        def work(processor):
            while True:
                try:
                    evt_id = pending.get_nowait()
                except queue.Empty:
                    return
                outcomes.append(processor.process(evt_id))

        run_together(lambda i: work(processors[i]), len(processors))
        assert outcomes == [Outcome.PROCESSED] * len(events), seed
        assert snapshot(kit) == expected, seed
