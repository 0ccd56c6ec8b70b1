"""The generic mirror (billing.objects): every event's data.object, of any type, through the receiver and a worker.

A type without a typed handler is mirrored and processed (it used to end unsupported_type); the mirror keeps
the latest object under the typed tables' order guard; an object without id that no other handler takes ends
failed_permanent with its reason.
"""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from devkit.factories import SubscriptionHistory, body_of, event, sign
from tests.support.constants import WEBHOOK_SECRET
from workers.handlers import HandlerRegistry
from workers.processor import Outcome

T0 = 1_760_000_000


def deliver(client, evt: dict) -> dict:
    """Stripe delivers ``evt`` to the platform endpoint; the receiver's JSON answer."""
    body = body_of(evt)
    answer = client.post("/webhooks/stripe", data=body, headers={"Stripe-Signature": sign(body, WEBHOOK_SECRET)})
    assert answer.status_code == 200, answer.get_json()
    return answer.get_json()


def mirrored(kit) -> list[dict]:
    return kit.query("SELECT id, object_type, account, livemode, data, deleted, source_event_id, "
                     "source_event_created FROM billing.objects ORDER BY id, livemode")


def at(created: int) -> datetime:
    return datetime.fromtimestamp(created, tz=timezone.utc)


def product(name: str, **extra) -> dict:
    return {"id": "prod_mirror", "object": "product", "name": name, "active": True, **extra}


@pytest.mark.parametrize("event_type, obj", [
    ("charge.succeeded", {"id": "ch_mirror", "object": "charge", "amount": 2500, "currency": "eur",
                          "customer": "cus_mirror", "paid": True}),
    ("product.created", {"id": "prod_mirror", "object": "product", "name": "Pro", "active": True}),
])
def test_a_type_without_a_typed_handler_is_mirrored_through_the_receiver_and_processed(
        kit, receiver_client, event_type, obj):
    evt = event(event_type, obj, created=T0, livemode=True)
    assert deliver(receiver_client, evt)["outcome"] == "received"

    assert kit.processor(modules=()).process(evt["id"]) is Outcome.PROCESSED
    row = kit.event(evt["id"])
    assert (row["status"], row["failure_reason"]) == ("processed", None)
    assert mirrored(kit) == [{"id": obj["id"], "object_type": obj["object"], "account": None, "livemode": True,
                              "data": obj, "deleted": False, "source_event_id": evt["id"],
                              "source_event_created": at(T0)}]
    assert {t: n for t, n in kit.billing_counts().items() if n} == {"objects": 1}


def test_a_typed_event_is_mirrored_beside_its_typed_row(kit):
    history = SubscriptionHistory()
    evt = history.lifecycle().events[1]  # customer.subscription.created
    assert kit.processor(modules=()).process(kit.record(evt)) is Outcome.PROCESSED

    assert kit.query("SELECT id, source_event_id FROM billing.subscriptions") == [
        {"id": history.subscription_id, "source_event_id": evt["id"]}]
    [row] = mirrored(kit)
    assert (row["id"], row["object_type"], row["data"], row["source_event_id"]) == (
        history.subscription_id, "subscription", evt["data"]["object"], evt["id"])


def test_the_mirror_keeps_the_newest_object_whatever_the_delivery_order(kit, receiver_client):
    processor = kit.processor(modules=())
    first = event("product.created", product("v1"), created=T0, event_id="evt_mirror_1")
    second = event("product.updated", product("v2"), created=T0 + 10, event_id="evt_mirror_2")
    # Same second as the second event: the event id orders them ('evt_mirror_3' > 'evt_mirror_2').
    tie = event("product.updated", product("v3"), created=T0 + 10, event_id="evt_mirror_3")

    for evt in (tie, second, first):  # newest first: each older one must lose
        deliver(receiver_client, evt)
        assert processor.process(evt["id"]) is Outcome.PROCESSED
    [row] = mirrored(kit)
    assert (row["data"]["name"], row["source_event_id"], row["source_event_created"]) == (
        "v3", "evt_mirror_3", at(T0 + 10))
    written = kit.query("SELECT updated_at FROM billing.objects")

    # A redelivery of the newest, applied again: not newer than itself, nothing written.
    kit.execute("UPDATE ledger.events SET status = 'received', processed_at = NULL WHERE id = %s", (tie["id"],))
    assert processor.process(tie["id"]) is Outcome.PROCESSED
    assert kit.query("SELECT updated_at FROM billing.objects") == written

    newest = event("product.updated", product("v4"), created=T0 + 11, event_id="evt_mirror_0")
    deliver(receiver_client, newest)
    assert processor.process(newest["id"]) is Outcome.PROCESSED
    assert [r["data"]["name"] for r in mirrored(kit)] == ["v4"]  # a later second wins whatever its id


@pytest.mark.parametrize("event_type, obj, deleted", [
    ("product.deleted", product("gone"), True),
    ("customer.deleted", {"id": "cus_gone", "object": "customer", "email": None}, True),
    # The object says so, whatever the event type.
    ("price.updated", {"id": "price_gone", "object": "price", "deleted": True}, True),
    # A canceled subscription is still there at Stripe: not a deletion.
    ("customer.subscription.deleted", None, False),
])
def test_a_deletion_marks_the_mirrored_object_deleted(kit, event_type, obj, deleted):
    if obj is None:
        history = SubscriptionHistory()
        obj = history._subscription("canceled", history.start, canceled_at=history.start, ended_at=history.start)
    evt = event(event_type, obj, created=T0)
    assert kit.processor(modules=()).process(kit.record(evt)) is Outcome.PROCESSED
    [row] = mirrored(kit)
    assert (row["id"], row["deleted"]) == (obj["id"], deleted)


def test_an_object_without_id_of_a_type_no_handler_takes_ends_failed_permanent_with_its_reason(
        kit, receiver_client):
    # Stripe's upcoming invoice: an invoice not created yet has no id.
    evt = event("invoice.upcoming", {"object": "invoice", "customer": "cus_1", "amount_due": 900}, created=T0)
    deliver(receiver_client, evt)

    assert kit.processor(modules=()).process(evt["id"]) is Outcome.FAILED_PERMANENT
    row = kit.event(evt["id"])
    assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed_permanent", "object_without_id", 1)
    assert row["last_error"] == ("data.object has no id: the generic mirror cannot keep it, and no other handler "
                                 "takes this type")
    assert set(kit.billing_counts().values()) == {0}


def test_an_object_without_a_type_of_a_type_no_handler_takes_is_unmappable_and_names_the_field(kit):
    evt = event("charge.succeeded", {"id": "ch_typeless", "amount": 1}, created=T0)
    assert kit.processor(modules=()).process(kit.record(evt)) is Outcome.FAILED_PERMANENT
    row = kit.event(evt["id"])
    assert (row["failure_reason"], row["last_error"]) == (
        "unmappable_payload", "data.object.object is missing or has the wrong type")
    assert set(kit.billing_counts().values()) == {0}


def test_an_object_without_id_is_left_to_the_other_handlers_of_its_type(kit):
    """An entitlement summary has no id: its typed handler keeps it, the mirror steps aside. So does a
    user's handler of a type whose object has no id."""
    summary = event("entitlements.active_entitlement_summary.updated", {
        "object": "entitlements.active_entitlement_summary", "customer": "cus_sum", "livemode": False,
        "entitlements": {"object": "list", "data": [{"id": "ent_1", "lookup_key": "sso", "feature": "feat_1"}]}},
        created=T0)
    upcoming = event("invoice.upcoming", {"object": "invoice", "customer": "cus_sum"}, created=T0)
    processor = kit.processor(modules=())
    seen = []
    processor.registry.register("invoice.upcoming", lambda ctx: seen.append(ctx.event_id))

    for evt in (summary, upcoming):
        assert processor.process(kit.record(evt)) is Outcome.PROCESSED, kit.event(evt["id"])
    assert seen == [upcoming["id"]]
    assert mirrored(kit) == []
    assert kit.query("SELECT customer_id, feature FROM billing.entitlements") == [
        {"customer_id": "cus_sum", "feature": "sso"}]


def test_a_registry_of_the_built_in_module_resolves_every_type():
    """Why unsupported_type no longer happens with the built-in handlers loaded: the mirror takes "*"."""
    from ledger.config import Settings
    from workers.billing.handlers import ObjectMirror, register_handlers

    registry = HandlerRegistry()
    register_handlers(registry, Settings())
    for event_type in ("charge.succeeded", "account.updated", "v1.billing.meter.error_report_triggered"):
        assert [type(h) for h in registry.resolve(event_type)] == [ObjectMirror]
