"""ledger.stripe_events' type rules, which the receiver, the workers and the CLI share: a thin payload,
the snapshot type a v1 thin notification's handlers take, the v2 namespace, and what a deletion is."""
from __future__ import annotations

import pytest

from devkit.factories import HEALTH_EVENT_TYPE, thin_notification
from ledger.stripe_events import HEALTH_GENERATION_FAILURE, handler_type, is_deletion, is_thin, is_v2


def test_a_thin_notification_is_thin_and_a_snapshot_event_is_not():
    assert is_thin(thin_notification("v1.customer.updated", related={"id": "cus_1", "object": "customer"},
                                     created=1_796_032_800))
    assert not is_thin({"id": "evt_1", "object": "event", "type": "customer.updated"})
    assert not is_thin({})


@pytest.mark.parametrize("event_type, applied_as", [
    ("v1.customer.subscription.updated", "customer.subscription.updated"),
    ("customer.subscription.updated", "customer.subscription.updated"),
    (HEALTH_GENERATION_FAILURE, HEALTH_GENERATION_FAILURE),
    # Only the prefix goes: a type that merely contains "v1." keeps it.
    ("acme.v1.thing", "acme.v1.thing"),
])
def test_handler_type_is_a_v1_notifications_snapshot_type_else_its_own(event_type, applied_as):
    assert handler_type(event_type) == applied_as


def test_the_v2_namespace_is_the_health_alerts_not_the_v1_notifications():
    assert is_v2(HEALTH_EVENT_TYPE) and is_v2("v2.core.account.updated")
    assert not is_v2("v1.customer.updated") and not is_v2("customer.updated")


@pytest.mark.parametrize("event_type, obj, deleted", [
    ("customer.deleted", {}, True),
    ("invoice.deleted", {}, True),
    ("product.updated", {"deleted": True}, True),
    (None, {"deleted": True}, True),
    # A canceled subscription is still listed by Stripe: its .deleted event is no deletion of the row.
    ("customer.subscription.deleted", {}, False),
    ("customer.updated", {"deleted": False}, False),
    (None, {}, False),
])
def test_is_deletion(event_type, obj, deleted):
    assert is_deletion(event_type, obj) is deleted
