"""Re-applying an applied event changes nothing; entitlements follow the subscription at every step."""
from __future__ import annotations

import dataclasses
import json

import pytest

from devkit.factories import BASIL_API, OLD_API, SubscriptionHistory, event
from workers.processor import Outcome

FEATURES = [{"feature": "reports"}, {"feature": "seats"}]
# After each lifecycle event: the subscription-derived features the customer holds.
EXPECTED_FEATURES = [
    [],        # customer.created
    FEATURES,  # subscription created, trialing
    FEATURES,  # active
    FEATURES,  # invoice.paid
    FEATURES,  # invoice.payment_failed (the subscription is still active)
    [],        # past_due
    [],        # invoice.paid (the subscription is still past_due until its own event)
    FEATURES,  # active again
    FEATURES,  # active, cancel_at_period_end
    [],        # canceled
]
ALL_ROWS = ("customers", "subscriptions", "invoices", "checkout_sessions", "entitlements",
            "entitlement_summaries", "subscription_transitions", "objects")


def everything(kit) -> dict[str, list[dict]]:
    """Every billing row, timestamps included: a no-op re-apply must not even touch updated_at."""
    return {t: kit.query(f"SELECT * FROM billing.{t} ORDER BY 1, 2") for t in ALL_ROWS}


def lose_ledger_update(kit, event_id: str) -> None:
    """As if the worker crashed after the business writes committed but before the ledger said so."""
    kit.execute("UPDATE ledger.events SET status = 'received', processed_at = NULL WHERE id = %s", (event_id,))


def features(kit, customer_id: str, source: str = "subscription") -> list[dict]:
    return kit.query("SELECT feature FROM billing.entitlements WHERE customer_id = %s AND source = %s "
                     "ORDER BY feature", (customer_id, source))


@pytest.mark.parametrize("api_version", [OLD_API, BASIL_API])
def test_entitlements_follow_the_lifecycle_and_reapplying_each_event_changes_nothing(kit, api_version):
    history = SubscriptionHistory(api_version=api_version).lifecycle()
    processor = kit.processor(modules=())
    assert len(history.events) == len(EXPECTED_FEATURES)
    for step, (evt, expected) in enumerate(zip(history.events, EXPECTED_FEATURES)):
        assert processor.process(kit.record(evt)) is Outcome.PROCESSED
        assert features(kit, history.customer_id) == expected, (step, evt["type"])
        rows = everything(kit)

        lose_ledger_update(kit, evt["id"])
        assert processor.process(evt["id"]) is Outcome.PROCESSED
        assert everything(kit) == rows, (step, evt["type"])
        assert kit.event(evt["id"])["attempts"] == 2


@pytest.mark.parametrize("api_version", [OLD_API, BASIL_API])
def test_reapplying_old_events_after_the_whole_history_changes_nothing(kit, api_version):
    history = SubscriptionHistory(api_version=api_version).lifecycle()
    processor = kit.processor(modules=())
    for evt in history.events:
        assert processor.process(kit.record(evt)) is Outcome.PROCESSED
    rows = everything(kit)
    transitions = len(rows["subscription_transitions"])
    assert transitions == sum(1 for e in history.events if e["type"].startswith("customer.subscription."))

    for evt in history.events:
        lose_ledger_update(kit, evt["id"])
        assert processor.process(evt["id"]) is Outcome.PROCESSED
    assert everything(kit) == rows
    assert kit.query("SELECT status FROM billing.subscriptions") == [{"status": "canceled"}]


def test_canceling_one_subscription_keeps_the_features_another_one_grants(kit):
    first = SubscriptionHistory(api_version=BASIL_API, features=("seats", "reports"))
    second = SubscriptionHistory(api_version=BASIL_API, features=("reports", "exports"),
                                 customer_id=first.customer_id, start=first.start + 3)
    processor = kit.processor(modules=())
    created = [first.add("customer.subscription.created", first._subscription("active", first.start)),
               second.add("customer.subscription.created", second._subscription("active", second.start))]
    for evt in created:
        assert processor.process(kit.record(evt)) is Outcome.PROCESSED
    assert [r["feature"] for r in features(kit, first.customer_id)] == ["exports", "reports", "seats"]

    canceled = first.add("customer.subscription.deleted", first._subscription("canceled", first.start,
                                                                                canceled_at=first.start + 50,
                                                                                ended_at=first.start + 50))
    assert processor.process(kit.record(canceled)) is Outcome.PROCESSED
    assert [r["feature"] for r in features(kit, first.customer_id)] == ["exports", "reports"]


def test_the_entitlements_map_adds_features_by_price_or_product(kit, settings, tmp_path):
    history = SubscriptionHistory(api_version=OLD_API)
    path = tmp_path / "entitlements.json"
    path.write_text(json.dumps({history.price_id: ["sso"], history.product_id: ["audit"]}))
    try:
        processor = kit.processor(dataclasses.replace(settings, entitlements_map_path=str(path)), modules=(),
                                  name="mapped")
        evt = history.add("customer.subscription.created", history._subscription("active", history.start))
        assert processor.process(kit.record(evt)) is Outcome.PROCESSED
    finally:
        kit.processor(modules=())  # the map is process-wide: load the default (none) again
    assert [r["feature"] for r in features(kit, history.customer_id)] == ["audit", "reports", "seats", "sso"]
    assert kit.query("SELECT features FROM billing.subscriptions")[0]["features"] == ["audit", "reports", "seats",
                                                                                      "sso"]


def summary_event(customer_id: str, keys: list[str], created: int) -> dict:
    return event("entitlements.active_entitlement_summary.updated", {
        "object": "entitlements.active_entitlement_summary", "customer": customer_id, "livemode": False,
        "entitlements": {"object": "list", "data": [
            {"object": "entitlements.active_entitlement", "id": f"ent_{k}", "lookup_key": k,
             "feature": f"feat_{k}"} for k in keys]}}, created=created)


def test_stripe_entitlement_summaries_apply_newest_first_and_leave_subscription_features_alone(kit):
    history = SubscriptionHistory(api_version=OLD_API)
    processor = kit.processor(modules=())
    sub = history.add("customer.subscription.created", history._subscription("active", history.start))
    older = summary_event(history.customer_id, ["api", "sso"], created=history.start + 10)
    newer = summary_event(history.customer_id, ["api"], created=history.start + 20)
    for evt in (sub, newer, older):  # the older summary arrives last
        assert processor.process(kit.record(evt)) is Outcome.PROCESSED
    assert features(kit, history.customer_id, "stripe") == [{"feature": "api"}]
    assert features(kit, history.customer_id, "subscription") == FEATURES
    rows = everything(kit)
    for evt in (older, newer):
        lose_ledger_update(kit, evt["id"])
        assert processor.process(evt["id"]) is Outcome.PROCESSED
    assert everything(kit) == rows

    emptied = summary_event(history.customer_id, [], created=history.start + 30)
    assert processor.process(kit.record(emptied)) is Outcome.PROCESSED
    assert features(kit, history.customer_id, "stripe") == []
    assert features(kit, history.customer_id, "subscription") == FEATURES
