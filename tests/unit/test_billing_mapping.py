"""workers/billing/mapping: pure Stripe object -> billing row mapping, old, basil and clover shapes; what each
row requires is what its handler declares."""
from __future__ import annotations

import copy
import json
from datetime import datetime, timezone

import pytest

from devkit.factories import BASIL_API, CLOVER_API, DAHLIA_API, OLD_API, SubscriptionHistory
from tests.support.constants import FIXTURES_DIR
from workers.billing import mapping
from workers.failures import UnmappablePayload
from workers.handlers import alternatives, describe

# Stripe's own example objects at its newest API version (../shared/stripe-fixtures/objects, read in place).
NEWEST_OBJECTS = FIXTURES_DIR / "objects"
needs_newest_objects = pytest.mark.skipif(not NEWEST_OBJECTS.is_dir(), reason=f"no {NEWEST_OBJECTS}")


def ts(value: int) -> datetime:
    return datetime.fromtimestamp(value, tz=timezone.utc)


def lifecycle(api_version: str) -> SubscriptionHistory:
    return SubscriptionHistory(api_version=api_version).lifecycle()


def subscription_object(api_version: str, index: int = 2) -> dict:
    return copy.deepcopy(lifecycle(api_version).events[index]["data"]["object"])


# --- subscriptions ---------------------------------------------------------------------------

def test_old_api_periods_are_read_from_the_subscription():
    sub = subscription_object(OLD_API)
    assert "current_period_start" in sub and "current_period_start" not in sub["items"]["data"][0]
    row = mapping.subscription_row(sub)
    assert row["current_period_start"] == ts(sub["current_period_start"])
    assert row["current_period_end"] == ts(sub["current_period_end"])


def test_basil_periods_are_read_from_the_items():
    sub = subscription_object(BASIL_API)
    item = sub["items"]["data"][0]
    assert "current_period_start" not in sub and "current_period_start" in item
    row = mapping.subscription_row(sub)
    assert row["current_period_start"] == ts(item["current_period_start"])
    assert row["current_period_end"] == ts(item["current_period_end"])


def test_basil_periods_span_all_items_earliest_start_to_latest_end():
    sub = subscription_object(BASIL_API)
    first = sub["items"]["data"][0]
    second = {**copy.deepcopy(first), "id": "si_second",
              "current_period_start": first["current_period_start"] - 100,
              "current_period_end": first["current_period_end"] + 500}
    sub["items"]["data"].append(second)
    row = mapping.subscription_row(sub)
    assert row["current_period_start"] == ts(first["current_period_start"] - 100)
    assert row["current_period_end"] == ts(first["current_period_end"] + 500)


def test_a_subscription_without_any_period_maps_to_null_periods():
    sub = subscription_object(BASIL_API)
    for item in sub["items"]["data"]:
        item.pop("current_period_start"), item.pop("current_period_end")
    row = mapping.subscription_row(sub)
    assert row["current_period_start"] is None and row["current_period_end"] is None


@pytest.mark.parametrize("api_version", [OLD_API, BASIL_API, CLOVER_API, DAHLIA_API])
def test_subscription_row_carries_the_ids_status_and_flags(api_version):
    history = SubscriptionHistory(api_version=api_version).lifecycle()
    sub = history.events[8]["data"]["object"]  # active, cancel_at_period_end
    row = mapping.subscription_row(sub)
    assert row["id"] == history.subscription_id
    assert row["customer_id"] == history.customer_id
    assert row["status"] == "active"
    assert row["price_id"] == history.price_id
    assert row["product_id"] == history.product_id
    assert row["quantity"] == 1
    assert row["cancel_at_period_end"] is True
    canceled = mapping.subscription_row(history.events[9]["data"]["object"])
    assert canceled["status"] == "canceled"
    assert canceled["canceled_at"] is not None and canceled["ended_at"] == canceled["canceled_at"]


def test_trial_end_is_mapped_and_booleans_are_not_taken_for_timestamps():
    sub = subscription_object(OLD_API, index=1)  # trialing
    assert mapping.subscription_row(sub)["trial_end"] == ts(sub["trial_end"])
    sub["trial_end"] = True
    assert mapping.subscription_row(sub)["trial_end"] is None


def test_expanded_customer_and_product_objects_are_read_as_ids():
    sub = subscription_object(BASIL_API)
    customer_id = sub["customer"]
    sub["customer"] = {"id": customer_id, "object": "customer", "email": "x@example.test"}
    price = sub["items"]["data"][0]["price"]
    product_id = price["product"]
    price["product"] = {"id": product_id, "object": "product", "metadata": {"features": "exports"}}
    row = mapping.subscription_row(sub)
    assert row["customer_id"] == customer_id
    assert row["product_id"] == product_id
    # An expanded product's metadata features count too.
    assert "exports" in row["features"]


def test_the_plan_is_read_when_there_is_no_price():
    sub = subscription_object(OLD_API)
    item = sub["items"]["data"][0]
    item.pop("price")
    sub["plan"] = {"id": "plan_gold", "object": "plan", "product": "prod_gold", "metadata": {"features": "gold"}}
    row = mapping.subscription_row(sub)
    assert (row["price_id"], row["product_id"]) == ("plan_gold", "prod_gold")
    assert row["features"] == ["gold"]


def test_quantity_falls_back_to_the_first_item():
    sub = subscription_object(BASIL_API)
    sub.pop("quantity")
    sub["items"]["data"][0]["quantity"] = 7
    assert mapping.subscription_row(sub)["quantity"] == 7


def test_features_come_from_price_metadata_trimmed_deduplicated_and_sorted():
    sub = subscription_object(BASIL_API)
    sub["items"]["data"][0]["price"]["metadata"] = {"features": " seats, reports ,, seats,api "}
    assert mapping.subscription_row(sub)["features"] == ["api", "reports", "seats"]


def test_features_from_the_entitlements_map_by_price_or_product_are_added():
    history = SubscriptionHistory(api_version=BASIL_API).lifecycle()
    sub = history.events[2]["data"]["object"]
    by_price = mapping.subscription_row(sub, {history.price_id: ["sso"]})
    assert by_price["features"] == ["reports", "seats", "sso"]
    by_product = mapping.subscription_row(sub, {history.product_id: ["audit", "seats"]})
    assert by_product["features"] == ["audit", "reports", "seats"]
    assert mapping.subscription_row(sub, {"price_other": ["nope"]})["features"] == ["reports", "seats"]


def test_a_subscription_without_features_grants_none():
    sub = subscription_object(BASIL_API)
    sub["items"]["data"][0]["price"]["metadata"] = {}
    assert mapping.subscription_row(sub)["features"] == []


@pytest.mark.parametrize("field, named", [("id", "data.object.id"), ("status", "data.object.status"),
                                          ("customer", "data.object.customer or data.object.customer_account")])
def test_a_subscription_missing_a_required_field_is_unmappable_and_names_it(field, named):
    sub = subscription_object(BASIL_API)
    sub.pop(field)
    with pytest.raises(UnmappablePayload) as info:
        mapping.subscription_row(sub)
    assert info.value.field == named
    assert named in str(info.value)


def clover(sub: dict, account: str = "acct_1Accountsv2Customer") -> dict:
    """An Accounts v2 customer's object at clover: customer null, customer_account set."""
    return {**sub, "customer": None, "customer_account": account}


def test_a_clover_subscription_of_an_accounts_v2_customer_is_keyed_by_its_customer_account():
    history = SubscriptionHistory(api_version=CLOVER_API, customer_account="acct_1Accountsv2Customer").lifecycle()
    for evt in history.events[1:]:
        row = (mapping.subscription_row if evt["type"].startswith("customer.subscription.") else mapping.invoice_row)(
            evt["data"]["object"])
        assert row["customer_id"] == "acct_1Accountsv2Customer", evt["type"]
    sub = subscription_object(BASIL_API)
    assert mapping.subscription_row(clover(sub))["customer_id"] == "acct_1Accountsv2Customer"
    # Both set (a v1 customer that also has an account): the customer id wins.
    assert mapping.subscription_row({**sub, "customer_account": "acct_other"})["customer_id"] == sub["customer"]
    with pytest.raises(UnmappablePayload, match="data.object.customer or data.object.customer_account"):
        mapping.subscription_row(clover(sub, account=None))


def test_clover_invoices_checkout_sessions_and_dunning_notices_read_the_customer_account():
    history = SubscriptionHistory(api_version=BASIL_API).lifecycle()
    inv = clover(history.events[3]["data"]["object"])
    assert mapping.invoice_row(inv)["customer_id"] == "acct_1Accountsv2Customer"
    assert mapping.invoice_row(inv)["subscription_id"] == history.subscription_id
    assert mapping.payment_failed_notice(inv)["customer_id"] == "acct_1Accountsv2Customer"
    session = clover({"id": "cs_1", "subscription": "sub_1", "mode": "subscription"})
    assert mapping.checkout_session_row(session)["customer_id"] == "acct_1Accountsv2Customer"
    # Optional there: neither set is a session without a customer, not an unmappable one.
    assert mapping.checkout_session_row(clover(session, account=None))["customer_id"] is None
    assert mapping.invoice_row(clover(inv, account=None))["customer_id"] is None


# What a row refuses is exactly what its handler declares (requires=): one list, read by both.
ROWS = {
    "customer": (mapping.CUSTOMER_REQUIRES, lambda o: mapping.customer_row(o, deleted=False),
                 lambda: {"id": "cus_1", "object": "customer"}),
    "subscription": (mapping.SUBSCRIPTION_REQUIRES, mapping.subscription_row, lambda: subscription_object(BASIL_API)),
    "invoice": (mapping.INVOICE_REQUIRES, mapping.invoice_row,
                lambda: copy.deepcopy(lifecycle(BASIL_API).events[3]["data"]["object"])),
    "checkout.session": (mapping.CHECKOUT_SESSION_REQUIRES, mapping.checkout_session_row,
                         lambda: {"id": "cs_1", "object": "checkout.session", "customer": "cus_1"}),
    "entitlement summary": (mapping.ENTITLEMENT_SUMMARY_REQUIRES, mapping.entitlement_summary,
                            lambda: {"customer": "cus_1", "entitlements": {"data": [{"lookup_key": "seats"}]}}),
}
REQUIREMENTS = [(name, requirement) for name, (requires, _, _) in ROWS.items() for requirement in requires]


def without(obj: dict, path: str) -> dict:
    """``obj`` (a data.object) with the field at the event path ``path`` set to null."""
    *parents, last = path.removeprefix("data.object.").split(".")
    node = obj
    for key in parents:
        node = node[key]
    node[last] = None
    return obj


@pytest.mark.parametrize("name, requirement", REQUIREMENTS, ids=[f"{n}:{describe(r)}" for n, r in REQUIREMENTS])
def test_a_row_refuses_an_object_lacking_a_declared_requirement_and_names_it_as_declared(name, requirement):
    _, to_row, valid = ROWS[name]
    to_row(valid())  # the valid object maps
    obj = valid()
    for path in alternatives(requirement):
        without(obj, path)
    with pytest.raises(UnmappablePayload) as info:
        to_row(obj)
    assert info.value.field == describe(requirement)


@pytest.mark.parametrize("name, requirement", [(n, r) for n, r in REQUIREMENTS if not isinstance(r, str)])
def test_any_one_alternative_of_a_declared_requirement_is_enough_for_the_row(name, requirement):
    _, to_row, valid = ROWS[name]
    for keep in alternatives(requirement):
        obj = valid()
        value = obj.get("customer") or "cus_kept"
        for path in alternatives(requirement):
            without(obj, path)
        obj[keep.removeprefix("data.object.")] = value
        to_row(obj)


# --- Stripe's newest example objects (2026-07-29.dahlia: after clover, basil changes kept) -----------

def newest(resource: str) -> dict:
    return json.loads((NEWEST_OBJECTS / f"{resource}__openapi.json").read_text())


@needs_newest_objects
def test_the_newest_subscription_shape_maps_periods_from_items_and_a_customer_or_its_account():
    sub = newest("subscription")
    item = sub["items"]["data"][0]
    assert "current_period_start" not in sub and "customer_account" in sub
    row = mapping.subscription_row(sub)
    assert (row["id"], row["customer_id"], row["status"]) == (sub["id"], sub["customer"], sub["status"])
    assert (row["current_period_start"], row["current_period_end"]) == (
        ts(item["current_period_start"]), ts(item["current_period_end"]))
    assert (row["price_id"], row["product_id"]) == (item["price"]["id"], item["price"]["product"])
    assert mapping.subscription_row(clover(sub))["customer_id"] == "acct_1Accountsv2Customer"


@needs_newest_objects
def test_the_newest_invoice_shape_reads_its_subscription_from_the_parent_and_a_customer_or_its_account():
    inv = newest("invoice")
    assert inv["subscription"] is None  # a stale key the fixture still has: the parent is read instead
    row = mapping.invoice_row(inv)
    assert row["subscription_id"] == inv["parent"]["subscription_details"]["subscription"]
    assert (row["id"], row["customer_id"], row["amount_due"]) == (inv["id"], inv["customer"], inv["amount_due"])
    assert mapping.invoice_row(clover(inv))["customer_id"] == "acct_1Accountsv2Customer"


@needs_newest_objects
def test_the_newest_checkout_session_shape_maps_with_or_without_a_customer():
    session = newest("checkout.session")
    assert session["customer"] is None and "customer_account" in session
    assert mapping.checkout_session_row(session)["customer_id"] is None
    assert mapping.checkout_session_row(clover(session))["customer_id"] == "acct_1Accountsv2Customer"


@pytest.mark.parametrize("value", [None, "", 42, {"no": "id"}])
def test_a_subscription_whose_customer_has_the_wrong_type_is_unmappable(value):
    sub = subscription_object(OLD_API)
    sub["customer"] = value
    with pytest.raises(UnmappablePayload, match="data.object.customer"):
        mapping.subscription_row(sub)


# --- invoices --------------------------------------------------------------------------------

def test_old_api_invoice_subscription_is_read_from_invoice_subscription():
    history = SubscriptionHistory(api_version=OLD_API).lifecycle()
    inv = history.events[3]["data"]["object"]
    assert inv["subscription"] == history.subscription_id and "parent" not in inv
    assert mapping.invoice_row(inv)["subscription_id"] == history.subscription_id


def test_basil_invoice_subscription_is_read_from_parent_subscription_details():
    history = SubscriptionHistory(api_version=BASIL_API).lifecycle()
    inv = history.events[3]["data"]["object"]
    assert "subscription" not in inv
    row = mapping.invoice_row(inv)
    assert row["subscription_id"] == history.subscription_id
    assert row["customer_id"] == history.customer_id


def test_a_null_top_level_subscription_still_falls_back_to_the_parent():
    inv = {"id": "in_1", "subscription": None,
           "parent": {"type": "subscription_details", "subscription_details": {"subscription": "sub_9"}}}
    assert mapping.invoice_subscription_id(inv) == "sub_9"


def test_expanded_invoice_subscription_and_customer_objects_are_read_as_ids():
    inv = {"id": "in_2", "customer": {"id": "cus_2", "object": "customer"},
           "parent": {"subscription_details": {"subscription": {"id": "sub_2", "object": "subscription"}}}}
    row = mapping.invoice_row(inv)
    assert (row["customer_id"], row["subscription_id"]) == ("cus_2", "sub_2")
    assert mapping.invoice_row({"id": "in_3", "subscription": {"id": "sub_3"}})["subscription_id"] == "sub_3"


def test_an_invoice_outside_a_subscription_has_no_subscription_id():
    assert mapping.invoice_row({"id": "in_4", "parent": {"type": "quote_details", "quote_details": {}}})[
        "subscription_id"] is None
    assert mapping.invoice_row({"id": "in_5", "parent": None})["subscription_id"] is None


def test_invoice_amounts_and_period_are_mapped_and_deleted_is_flagged():
    history = SubscriptionHistory(api_version=OLD_API).lifecycle()
    inv = history.events[3]["data"]["object"]
    row = mapping.invoice_row(inv, deleted=True)
    assert row["amount_due"] == 1500 and row["amount_paid"] == 1500 and row["currency"] == "usd"
    assert row["period_start"] == ts(inv["period_start"]) and row["period_end"] == ts(inv["period_end"])
    assert row["status"] == "paid" and row["billing_reason"] == "subscription_create" and row["deleted"] is True


def test_an_invoice_without_id_is_unmappable():
    with pytest.raises(UnmappablePayload, match="data.object.id"):
        mapping.invoice_row({"object": "invoice", "amount_due": 5})


# --- customers, checkout sessions, entitlement summaries -------------------------------------

def test_customer_row_maps_contact_fields_and_metadata():
    row = mapping.customer_row({"id": "cus_1", "email": "a@b.test", "name": "A", "metadata": {"k": "v"}},
                               deleted=False)
    assert row == {"id": "cus_1", "email": "a@b.test", "name": "A", "deleted": False, "metadata": {"k": "v"}}


def test_a_deleted_customer_is_flagged_by_event_type_or_by_the_object():
    assert mapping.customer_row({"id": "cus_1"}, deleted=True)["deleted"] is True
    assert mapping.customer_row({"id": "cus_1", "deleted": True}, deleted=False)["deleted"] is True
    assert mapping.customer_row({"id": "cus_1", "metadata": None}, deleted=False)["metadata"] == {}


def test_a_customer_without_id_is_unmappable():
    with pytest.raises(UnmappablePayload, match="data.object.id"):
        mapping.customer_row({"email": "a@b.test"}, deleted=False)


def test_checkout_session_links_customer_subscription_and_client_reference():
    row = mapping.checkout_session_row({"id": "cs_1", "customer": {"id": "cus_1"}, "subscription": "sub_1",
                                        "client_reference_id": "user-42", "mode": "subscription",
                                        "status": "complete", "payment_status": "paid"})
    assert row == {"id": "cs_1", "customer_id": "cus_1", "subscription_id": "sub_1",
                   "client_reference_id": "user-42", "mode": "subscription", "status": "complete",
                   "payment_status": "paid"}


def test_entitlement_summary_reads_lookup_keys_or_feature_ids():
    summary = {"customer": "cus_1", "entitlements": {"data": [
        {"lookup_key": "seats", "feature": {"id": "feat_1"}},
        {"lookup_key": None, "feature": "feat_2"},
        {"feature": {"id": "feat_3", "lookup_key": "ignored"}},
        {"lookup_key": "seats"},
    ]}}
    assert mapping.entitlement_summary(summary) == ("cus_1", ["feat_2", "feat_3", "seats"])
    assert mapping.entitlement_summary({"customer": {"id": "cus_2"}, "entitlements": {"data": []}}) == ("cus_2", [])


def test_entitlement_summary_without_a_list_is_unmappable():
    with pytest.raises(UnmappablePayload, match=r"data\.object\.entitlements\.data"):
        mapping.entitlement_summary({"customer": "cus_1", "entitlements": {}})
    with pytest.raises(UnmappablePayload, match=r"data\.object\.customer"):
        mapping.entitlement_summary({"entitlements": {"data": []}})


def test_an_entitlement_without_key_is_unmappable_and_the_message_names_its_index():
    with pytest.raises(UnmappablePayload) as info:
        mapping.entitlement_summary({"customer": "cus_1",
                                     "entitlements": {"data": [{"lookup_key": "a"}, {"lookup_key": ""}]}})
    assert info.value.field == "data.object.entitlements.data[1].lookup_key"
