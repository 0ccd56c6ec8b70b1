"""The collections the fake serves under /v1/ and the list filters Stripe offers on each."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from devkit.stripe_api.params import bad_param, string, string_list

SUBSCRIPTION_STATUSES = {"active", "all", "canceled", "ended", "incomplete", "incomplete_expired", "past_due",
                         "paused", "trialing", "unpaid"}


def _ref(value: Any) -> Any:
    """An id whether the field holds the id or the expanded object; booleans as the query spells them."""
    if isinstance(value, dict):
        return value.get("id")
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def _field(name: str) -> Callable[[dict, Any], bool]:
    return lambda obj, value: _ref(obj.get(name)) == string(name, value)


def _price_ids(sub: dict) -> set[str]:
    items = (sub.get("items") or {}).get("data") or []
    return {_ref(item.get("price")) for item in items} | ({_ref(sub["plan"])} if sub.get("plan") else set())


def _invoice_subscription(inv: dict, value: Any) -> bool:
    details = ((inv.get("parent") or {}).get("subscription_details") or {})
    return string("subscription", value) in (_ref(inv.get("subscription")), _ref(details.get("subscription")))


def _subscription_status(sub: dict, value: Any) -> bool:
    status = string("status", value)
    if status not in SUBSCRIPTION_STATUSES:
        raise bad_param("status", f"Invalid status: must be one of {', '.join(sorted(SUBSCRIPTION_STATUSES))}")
    if status == "all":
        return True
    if status == "ended":
        return sub.get("status") in ("canceled", "incomplete_expired")
    return sub.get("status") == status


@dataclass(frozen=True)
class Collection:
    object_type: str
    filters: Mapping[str, Callable[[dict, Any], bool]]
    required: tuple[str, ...] = ()
    # What applies when the request omits the parameter (subscriptions hide canceled ones).
    defaults: Mapping[str, Callable[[dict], bool]] = field(default_factory=dict)


_customer = {"customer": _field("customer")}
COLLECTIONS: dict[str, Collection] = {
    "customers": Collection("customer", {"email": _field("email")}),
    "subscriptions": Collection("subscription", {
        **_customer, "status": _subscription_status, "collection_method": _field("collection_method"),
        "price": lambda sub, value: string("price", value) in _price_ids(sub)},
        defaults={"status": lambda sub: sub.get("status") != "canceled"}),
    "subscription_items": Collection("subscription_item", {"subscription": _field("subscription")},
                                     required=("subscription",)),
    "invoices": Collection("invoice", {**_customer, "status": _field("status"),
                                       "subscription": _invoice_subscription,
                                       "collection_method": _field("collection_method")}),
    "invoiceitems": Collection("invoiceitem", {**_customer, "invoice": _field("invoice")}),
    "products": Collection("product", {"active": _field("active"), "shippable": _field("shippable"),
                                       "ids": lambda p, v: p.get("id") in string_list("ids", v)}),
    "prices": Collection("price", {"active": _field("active"), "currency": _field("currency"),
                                   "product": _field("product"), "type": _field("type"),
                                   "lookup_keys": lambda p, v: p.get("lookup_key") in string_list("lookup_keys", v)}),
    "plans": Collection("plan", {"active": _field("active"), "product": _field("product")}),
    "coupons": Collection("coupon", {}),
    "promotion_codes": Collection("promotion_code", {**_customer, "active": _field("active"),
                                                     "code": _field("code"), "coupon": _field("coupon")}),
    "charges": Collection("charge", {**_customer, "payment_intent": _field("payment_intent")}),
    "payment_intents": Collection("payment_intent", _customer),
    "setup_intents": Collection("setup_intent", {**_customer, "payment_method": _field("payment_method")}),
    "refunds": Collection("refund", {"charge": _field("charge"), "payment_intent": _field("payment_intent")}),
    "disputes": Collection("dispute", {"charge": _field("charge"), "payment_intent": _field("payment_intent")}),
    "payment_methods": Collection("payment_method", {**_customer, "type": _field("type")}),
    "credit_notes": Collection("credit_note", {**_customer, "invoice": _field("invoice")}),
    "checkout/sessions": Collection("checkout.session", {
        **_customer, "payment_intent": _field("payment_intent"), "subscription": _field("subscription"),
        "status": _field("status")}),
    "tax_rates": Collection("tax_rate", {"active": _field("active")}),
}
