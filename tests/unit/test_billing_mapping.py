"""workers/billing/mapping: pure Stripe object -> billing row mapping, old and basil shapes."""
from __future__ import annotations

import copy
from datetime import datetime, timezone

import pytest

from devkit.factories import BASIL_API, OLD_API, SubscriptionHistory
from workers.billing import mapping
from workers.failures import UnmappablePayload


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


@pytest.mark.parametrize("api_version", [OLD_API, BASIL_API])
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


@pytest.mark.parametrize("field", ["id", "customer", "status"])
def test_a_subscription_missing_a_required_field_is_unmappable_and_names_it(field):
    sub = subscription_object(BASIL_API)
    sub.pop(field)
    with pytest.raises(UnmappablePayload) as info:
        mapping.subscription_row(sub)
    assert info.value.field == f"data.object.{field}"
    assert f"data.object.{field}" in str(info.value)


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
