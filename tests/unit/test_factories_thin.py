"""devkit/factories for thin events and newer API versions: clover and dahlia subscription histories,
Accounts v2 customers, API paths of bare objects, thin notifications, their v2 events, health events,
and what the stripe library and the receiver make of them. Pure: no database, no server."""
from __future__ import annotations

import pytest
import stripe
from stripe.events import UnknownEventNotification, V1CustomerSubscriptionUpdatedEventNotification

from devkit import factories
from devkit.factories import (BASIL_API, CLOVER_API, DAHLIA_API, HEALTH_EVENT_TYPE, SubscriptionHistory, body_of,
                              health_event, incoming, object_path, related_object, sign, thin_notification, thin_twin,
                              v2_event)
from ledger import stripe_events as envelope
from workers import thin
from workers.billing import mapping

SECRET = "whsec_thin_unit"
T0 = 1_800_000_000  # 2027-01-15T08:00:00Z
CLIENT = stripe.StripeClient("sk_test_x")


def objects_of(history: SubscriptionHistory, object_type: str) -> list[dict]:
    return [e["data"]["object"] for e in history.events if e["data"]["object"]["object"] == object_type]


# -- newer API versions --

@pytest.mark.parametrize("version", [CLOVER_API, DAHLIA_API])
def test_newer_histories_keep_the_basil_shape_and_add_the_fields_stripe_added_since(version):
    history = SubscriptionHistory(api_version=version).lifecycle()
    assert {e["api_version"] for e in history.events} == {version}
    for sub in objects_of(history, "subscription"):
        item = sub["items"]["data"][0]
        assert "current_period_end" not in sub and "plan" not in sub
        assert item["current_period_end"] - item["current_period_start"] == 30 * 86400
        assert sub["billing_mode"]["type"] == "flexible"
        assert sub["customer"] == history.customer_id and sub["customer_account"] is None
        assert sub["discounts"] == [] and item["discounts"] == []
    for inv in objects_of(history, "invoice"):
        assert "subscription" not in inv
        assert inv["parent"]["subscription_details"]["subscription"] == history.subscription_id
        assert inv["customer_account"] is None and inv["amount_overpaid"] == 0 and inv["total_taxes"] == []
        assert inv["amount_remaining"] == inv["amount_due"] - inv["amount_paid"]


def test_only_dahlia_histories_carry_billing_schedules_and_basil_ones_none_of_the_newer_fields():
    dahlia = objects_of(SubscriptionHistory(api_version=DAHLIA_API).lifecycle(), "subscription")
    clover = objects_of(SubscriptionHistory(api_version=CLOVER_API).lifecycle(), "subscription")
    basil = SubscriptionHistory(api_version=BASIL_API).lifecycle()
    assert all(sub["billing_schedules"] == [] for sub in dahlia)
    assert not any("billing_schedules" in sub for sub in clover)
    newer = {"billing_mode", "customer_account", "discounts", "amount_overpaid", "total_taxes"}
    assert not any(newer & set(obj) for obj in objects_of(basil, "subscription") + objects_of(basil, "invoice"))


def test_an_accounts_v2_customer_is_named_by_customer_account_and_the_rows_key_it_so():
    history = SubscriptionHistory(api_version=CLOVER_API, customer_account="acct_1V2Customer").lifecycle()
    subs, invoices = objects_of(history, "subscription"), objects_of(history, "invoice")
    assert subs and invoices
    for obj in subs + invoices:
        assert obj["customer"] is None and obj["customer_account"] == "acct_1V2Customer"
    assert {mapping.subscription_row(sub)["customer_id"] for sub in subs} == {"acct_1V2Customer"}
    assert {mapping.invoice_row(inv)["subscription_id"] for inv in invoices} == {history.subscription_id}
    assert {mapping.invoice_row(inv)["customer_id"] for inv in invoices} == {"acct_1V2Customer"}


def test_customer_account_before_clover_is_refused():
    with pytest.raises(ValueError, match="clover"):
        SubscriptionHistory(api_version=BASIL_API, customer_account="acct_1")


# -- API paths --

def test_object_path_is_the_api_path_that_retrieves_each_bare_object():
    history = SubscriptionHistory(api_version=CLOVER_API).lifecycle()
    sub, inv = objects_of(history, "subscription")[0], objects_of(history, "invoice")[0]
    cases = {
        "/v1/customers/cus_1": factories.customer(created=T0, customer_id="cus_1"),
        "/v1/products/prod_1": factories.product(created=T0, product_id="prod_1"),
        "/v1/prices/price_1": factories.price(created=T0, product="prod_1", price_id="price_1"),
        "/v1/payment_methods/pm_1": factories.payment_method(created=T0, payment_method_id="pm_1"),
        "/v1/payment_intents/pi_1": factories.payment_intent(created=T0, payment_intent_id="pi_1"),
        "/v1/charges/ch_1": factories.charge(created=T0, charge_id="ch_1"),
        "/v1/refunds/re_1": factories.refund(created=T0, charge="ch_1", amount=100, refund_id="re_1"),
        "/v1/disputes/dp_1": factories.dispute(created=T0, charge="ch_1", amount=100, dispute_id="dp_1"),
        "/v1/checkout/sessions/cs_test_1": {"id": "cs_test_1", "object": "checkout.session"},
        f"/v1/subscriptions/{sub['id']}": sub,
        f"/v1/invoices/{inv['id']}": inv,
    }
    assert {path: object_path(obj) for path, obj in cases.items()} == {path: path for path in cases}
    # The worker's own map (what a health alert's object is fetched from) agrees with the fake's.
    assert {path: f"{thin.collection_path(obj['object'])}/{obj['id']}" for path, obj in cases.items()} == {
        path: path for path in cases}
    assert related_object(sub) == {"id": sub["id"], "type": "subscription", "url": f"/v1/subscriptions/{sub['id']}"}


@pytest.mark.parametrize("obj", [{"id": "ent_1", "object": "entitlements.active_entitlement_summary"},
                                 {"id": "x_1"}, {"object": "invoice"}])
def test_object_path_refuses_an_object_no_api_path_retrieves(obj):
    with pytest.raises(ValueError):
        object_path(obj)


# -- thin notifications and their v2 events --

def test_a_thin_notification_is_what_stripe_posts():
    sub = objects_of(SubscriptionHistory(api_version=CLOVER_API).lifecycle(), "subscription")[0]
    n = thin_notification("v1.customer.subscription.updated", related=sub, created=T0 + 0.123,
                          event_id="evt_thin_1", context="acct_1Connected")
    assert n == {"id": "evt_thin_1", "object": "v2.core.event", "type": "v1.customer.subscription.updated",
                 "created": "2027-01-15T08:00:00.123Z", "livemode": False, "context": "acct_1Connected",
                 "related_object": {"id": sub["id"], "type": "subscription",
                                    "url": f"/v1/subscriptions/{sub['id']}"}}
    bare = thin_notification("v2.core.account.updated", created=T0, livemode=True)
    assert bare["created"] == "2027-01-15T08:00:00.000Z" and bare["livemode"] is True
    assert "context" not in bare and "related_object" not in bare


def test_created_is_rendered_to_the_nearest_millisecond():
    assert thin_notification("v2.x", created=T0 + 59.9996)["created"] == "2027-01-15T08:01:00.000Z"
    assert thin_notification("v2.x", created=T0 + 0.0004)["created"] == "2027-01-15T08:00:00.000Z"


def test_the_thin_twin_of_a_snapshot_event_points_at_its_object_a_little_later():
    snapshot = factories.event("customer.subscription.updated", {"id": "sub_1", "object": "subscription"},
                               created=T0, livemode=True, account="acct_1Connected")
    twin = thin_twin(snapshot, event_id="evt_twin_1")
    assert twin == {"id": "evt_twin_1", "object": "v2.core.event", "type": "v1.customer.subscription.updated",
                    "created": "2027-01-15T08:00:00.250Z", "livemode": True, "context": "acct_1Connected",
                    "related_object": {"id": "sub_1", "type": "subscription", "url": "/v1/subscriptions/sub_1"}}
    platform = factories.event("invoice.paid", {"id": "in_1", "object": "invoice"}, created=T0)
    assert "context" not in thin_twin(platform, offset_s=1.5)
    assert thin_twin(platform, offset_s=1.5)["created"] == "2027-01-15T08:00:01.500Z"


def test_the_v2_event_of_a_notification_adds_data_changes_and_reason():
    n = thin_notification("v1.invoice.paid", related={"id": "in_1", "object": "invoice"}, created=T0)
    assert v2_event(n) == {**n, "changes": None, "reason": None}
    with_data = v2_event({**n, "reason": {"type": "request"}}, data={"k": [1]})
    assert with_data["data"] == {"k": [1]} and with_data["reason"] == {"type": "request"}
    with_data["related_object"]["id"] = "in_changed"
    assert n["related_object"]["id"] == "in_1"  # the v2 event shares nothing with its notification


def test_a_health_event_carries_the_object_in_its_v2_events_impact_with_a_dashboard_url():
    inv = {"id": "in_1Lost", "object": "invoice"}
    n, v2 = health_event(inv, impact_event_type="invoice.paid", created=T0 + 0.5, context="acct_1Connected",
                         alert_id="halert_1")
    assert n["type"] == HEALTH_EVENT_TYPE == "v2.core.health.event_generation_failure.resolved"
    assert n["context"] == "acct_1Connected" and "related_object" not in n
    assert {k: v2[k] for k in n} == n
    assert v2["data"]["impact"] == {
        "event_type": "invoice.paid", "related_object_id": "in_1Lost", "context": "acct_1Connected",
        "related_object": {"id": "in_1Lost", "type": "invoice", "url": "https://dashboard.stripe.com/invoices/in_1Lost"}}
    assert v2["data"]["alert_id"] == "halert_1" and v2["data"]["severity"] == "critical"
    assert v2["data"]["resolved_at"] == "2027-01-15T08:00:00.500Z"
    n2, platform = health_event(inv, impact_event_type="invoice.paid", created=T0, severity="warning")
    assert "context" not in n2 and "context" not in platform["data"]["impact"]
    assert platform["data"]["severity"] == "warning" and platform["data"]["alert_id"].startswith("halert_")


# -- what the stripe library and the receiver make of them --

def test_a_signed_thin_notification_parses_with_the_stripe_library_as_its_class():
    n = thin_twin(factories.event("customer.subscription.updated", {"id": "sub_1", "object": "subscription"},
                                  created=T0, account="acct_1Connected"))
    body = body_of(n)
    parsed = CLIENT.parse_event_notification(body, sign(body, SECRET), SECRET)
    assert isinstance(parsed, V1CustomerSubscriptionUpdatedEventNotification)
    assert (parsed.id, parsed.created, str(parsed.context)) == (n["id"], n["created"], "acct_1Connected")
    assert (parsed.related_object.id, parsed.related_object.url) == ("sub_1", "/v1/subscriptions/sub_1")
    with pytest.raises(stripe.SignatureVerificationError):
        CLIENT.parse_event_notification(body, sign(body, "whsec_other"), SECRET)


def test_a_signed_health_notification_parses_as_an_unknown_event_notification():
    n, _ = health_event({"id": "in_1", "object": "invoice"}, impact_event_type="invoice.paid", created=T0,
                        context="acct_1Connected")
    body = body_of(n)
    parsed = CLIENT.parse_event_notification(body, sign(body, SECRET), SECRET)
    assert type(parsed) is UnknownEventNotification
    assert parsed.type == HEALTH_EVENT_TYPE and parsed.related_object is None
    assert str(parsed.context) == "acct_1Connected"


def test_incoming_records_a_thin_notification_as_the_receiver_does():
    n = thin_notification("v1.invoice.paid", related={"id": "in_1", "object": "invoice"}, created=T0 + 0.123,
                          context="acct_1Connected")
    recorded = incoming(n)
    assert (recorded.created, recorded.account, recorded.api_version) == (T0 + 0.123, "acct_1Connected", None)
    assert recorded.payload == body_of(n)
    assert recorded == envelope.parse_notification(body_of(n).encode())


def test_incoming_still_records_a_snapshot_event_as_it_is():
    snapshot = factories.event("invoice.paid", {"id": "in_1", "object": "invoice"}, created=T0,
                               api_version=CLOVER_API, account="acct_1Connected")
    recorded = incoming(snapshot)
    assert (recorded.created, recorded.account, recorded.api_version) == (T0, "acct_1Connected", CLOVER_API)
    assert recorded == envelope.parse_event(body_of(snapshot).encode())
