"""workers/handlers: what a handler requires of an event, checked before any handler runs.

A requirement is a dotted path into the event, or a tuple of alternatives; present means the key exists and
its value is neither None nor "". The first unmet requirement, of the handlers in resolve order, is refused
with UnmappablePayload naming the field, the handler and the event's API version.
"""
from __future__ import annotations

import pytest

from workers.failures import UnmappablePayload, classify
from workers.handlers import HandlerRegistry, describe, handler, is_present

CUSTOMER = ("data.object.customer", "data.object.customer_account")
NEWER = "2026-07-29.dahlia"


def apply_subscription(ctx):
    pass


def notify_sales(ctx):
    pass


def subscription_event(**obj) -> dict:
    return {"id": "evt_1", "type": "customer.subscription.updated", "api_version": NEWER,
            "data": {"object": {"id": "sub_1", "object": "subscription", **obj}}}


def refusal(registry: HandlerRegistry, event: dict, api_version: str | None = NEWER) -> UnmappablePayload:
    with pytest.raises(UnmappablePayload) as info:
        registry.check_required(event["type"], event, api_version)
    return info.value


@pytest.fixture
def registry() -> HandlerRegistry:
    reg = HandlerRegistry()
    reg.register("customer.subscription.*", apply_subscription, requires=["data.object.id", CUSTOMER])
    return reg


def test_an_event_that_has_every_required_field_passes(registry):
    registry.check_required("customer.subscription.updated", subscription_event(customer="cus_1"), NEWER)
    # Any one alternative will do: an Accounts v2 customer has customer_account, customer null.
    registry.check_required("customer.subscription.updated",
                            subscription_event(customer=None, customer_account="acct_1"), NEWER)


def test_a_missing_field_is_refused_naming_the_field_the_handler_and_the_api_version(registry):
    refused = refusal(registry, subscription_event(customer=None, customer_account=None))
    assert refused.field == "data.object.customer or data.object.customer_account"
    message = str(refused)
    assert message.startswith("data.object.customer or data.object.customer_account is missing")
    assert "apply_subscription" in message and NEWER in message
    assert "replay after an upgrade re-applies it" in message
    assert len(message) < 200, "the message is a log line and a column, not an essay"
    # How the worker records it: failed_permanent / unmappable_payload, the message as last_error.
    failure = classify(refused)
    assert (failure.kind.value, failure.reason, failure.message) == ("permanent", "unmappable_payload", message)


def test_an_event_without_an_api_version_says_so(registry):
    assert "API version unknown" in str(refusal(registry, subscription_event(), api_version=None))


@pytest.mark.parametrize("obj, present", [
    ({"customer": "cus_1"}, True),
    ({"customer": {"id": "cus_1", "object": "customer"}}, True),  # expanded
    ({"customer": 0}, True),           # a value of the wrong type is present: the row refuses it, naming it
    ({"customer": False}, True),
    ({"customer": []}, True),          # an empty list or object is a value Stripe sent
    ({"customer": {}}, True),
    ({"customer": None}, False),       # a field a version does not fill comes as null
    ({"customer": ""}, False),
    ({}, False),
])
def test_present_means_the_key_exists_and_is_neither_none_nor_empty(obj, present):
    assert is_present({"data": {"object": obj}}, "data.object.customer") is present


def test_a_path_through_a_missing_or_non_object_parent_is_absent():
    assert not is_present({"data": {"object": {"parent": None}}}, "data.object.parent.subscription_details")
    assert not is_present({"data": {"object": {"parent": "in_1"}}}, "data.object.parent.subscription_details")
    assert not is_present({"data": None}, "data.object.id")
    assert is_present({"data": {"object": {"parent": {"subscription_details": {"subscription": "sub_1"}}}}},
                      "data.object.parent.subscription_details.subscription")


def test_the_first_unmet_requirement_of_the_first_handler_in_order_is_the_one_reported(registry):
    registry.register("customer.subscription.updated", notify_sales, requires=["data.object.status"])
    event = subscription_event(customer=None)
    event["data"]["object"].pop("id")
    assert refusal(registry, event).field == "data.object.id"  # apply_subscription's first
    event["data"]["object"]["id"] = "sub_1"
    assert refusal(registry, event).field == describe(CUSTOMER)  # then its second
    event["data"]["object"]["customer"] = "cus_1"
    refused = refusal(registry, event)  # then the next handler's
    assert (refused.field, "notify_sales" in str(refused)) == ("data.object.status", True)


def test_only_the_handlers_of_the_type_are_checked(registry):
    registry.register("invoice.*", notify_sales, requires=["data.object.amount_due"])
    registry.check_required("customer.subscription.updated", subscription_event(customer="cus_1"), NEWER)
    registry.check_required("charge.succeeded", {"data": {"object": {}}}, NEWER)  # no handler: nothing required


def test_a_handler_matching_through_several_patterns_requires_what_each_pattern_declared():
    reg = HandlerRegistry()
    reg.register("customer.subscription.*", apply_subscription, requires=["data.object.id"])
    reg.register("customer.subscription.deleted", apply_subscription, requires=["data.object.ended_at"])
    assert reg.requirements("customer.subscription.deleted") == [
        (apply_subscription, ("data.object.id", "data.object.ended_at"))]
    assert reg.requirements("customer.subscription.updated") == [(apply_subscription, ("data.object.id",))]
    deleted = {**subscription_event(), "type": "customer.subscription.deleted"}
    assert refusal(reg, deleted).field == "data.object.ended_at"


def test_registering_a_pair_again_adds_requirements_without_repeating_them():
    reg = HandlerRegistry()
    reg.register("invoice.paid", notify_sales, requires=["data.object.id"])
    reg.register("invoice.paid", notify_sales, requires=["data.object.id", "data.object.customer"])
    [entry] = reg.entries()
    assert (entry.pattern, entry.handler, entry.requires) == (
        "invoice.paid", notify_sales, ("data.object.id", "data.object.customer"))


def test_the_registry_decorator_declares_requirements_for_every_pattern():
    reg = HandlerRegistry()

    @reg.handler("invoice.paid", "invoice.finalized", requires=[["data.object.id", "data.object.number"]])
    def fn(ctx):
        pass
    # A list of alternatives is kept as a tuple, as declared alternatives are.
    assert [e.requires for e in reg.entries()] == [(("data.object.id", "data.object.number"),)] * 2
    assert reg.requirements("invoice.paid") == [(fn, (("data.object.id", "data.object.number"),))]


def test_a_v2_event_is_checked_against_v2_handlers_only(registry):
    reg = HandlerRegistry()
    reg.register("*", apply_subscription, requires=["data.object.id"])
    reg.register("v2.core.health.*", notify_sales, requires=["data.impact"])
    thin = {"id": "evt_1", "object": "v2.core.event", "type": "v2.core.health.event_generation_failure.resolved"}
    assert refusal(reg, thin).field == "data.impact"  # the wildcard's data.object.id is not its concern
    reg.check_required(thin["type"], {**thin, "data": {"impact": {"event_type": "invoice.paid"}}}, None)


@pytest.mark.parametrize("bad", ["", "data..object", ".id", "id.", (), ("data.object.id", ""), 42])
def test_a_malformed_requirement_is_refused_when_declared(bad):
    with pytest.raises(ValueError, match="requirement"):
        HandlerRegistry().register("invoice.paid", notify_sales, requires=[bad])
    with pytest.raises(ValueError, match="requirement"):
        handler("invoice.paid", requires=[bad])


def test_requires_is_a_list_not_a_bare_path():
    with pytest.raises(TypeError, match="list of requirements"):
        HandlerRegistry().register("invoice.paid", notify_sales, requires="data.object.id")


def test_a_callable_handler_is_named_by_its_class():
    class SubscriptionHandler:
        def __call__(self, ctx):
            pass

    reg = HandlerRegistry()
    reg.register("customer.subscription.updated", SubscriptionHandler(), requires=["data.object.id"])
    event = subscription_event()
    event["data"]["object"].pop("id")
    assert "SubscriptionHandler" in str(refusal(reg, event))
