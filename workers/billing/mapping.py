"""Mapping Stripe objects to billing rows. Pure: no IO, tested without a database.

Payload shapes differ by API version and are read both ways:
* subscription periods sit on the subscription before 2025-03-31.basil and on
  its items after;
* an invoice's subscription id moved from ``invoice.subscription`` to
  ``invoice.parent.subscription_details.subscription``;
* ``price`` replaced ``plan`` on subscription items; both are read;
* from 2025-09-30.clover on, an object of an Accounts v2 customer may carry
  ``customer_account`` ("acct_...") with ``customer`` null: the customer id is
  ``customer``, else ``customer_account``.
A field the row cannot do without raises UnmappablePayload naming it. Those
fields are the ``*_REQUIRES`` constants below: the built-in handlers declare
them (``requires=``), so the worker refuses an event lacking one before any
handler runs, and the rows check the same paths.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping

from ledger.stripe_events import is_deletion
from workers.failures import PermanentError, UnmappablePayload
from workers.handlers import Requirement, alternatives, describe, value_at

Obj = Mapping[str, Any]
# Objects are parsed JSON, so their mappings are dicts: the checks below ask for dict (asking an ABC such as
# Mapping costs a fifth of a handler's time on a rebuild).

# The paths below are the event's (what handlers declare); a row reads them inside data.object.
_OBJECT = "data.object."
ID = "data.object.id"
STATUS = "data.object.status"
# Accounts v2 (2025-09-30.clover on): customer null, customer_account "acct_..." instead.
CUSTOMER = ("data.object.customer", "data.object.customer_account")
SUMMARY_CUSTOMER = "data.object.customer"
SUMMARY_ENTITLEMENTS = "data.object.entitlements.data"

CUSTOMER_REQUIRES: tuple[Requirement, ...] = (ID,)
# The customer id keys the customer's entitlements: a subscription cannot do without one.
SUBSCRIPTION_REQUIRES: tuple[Requirement, ...] = (ID, CUSTOMER, STATUS)
INVOICE_REQUIRES: tuple[Requirement, ...] = (ID,)
CHECKOUT_SESSION_REQUIRES: tuple[Requirement, ...] = (ID,)
ENTITLEMENT_SUMMARY_REQUIRES: tuple[Requirement, ...] = (SUMMARY_CUSTOMER, SUMMARY_ENTITLEMENTS)


class ObjectWithoutId(PermanentError):
    """The event's object has no id (an upcoming invoice, a summary): the generic mirror,
    keyed by id, cannot keep it, and no other handler takes its type."""

    reason = "object_without_id"

    def __init__(self, where: str = "data.object"):
        super().__init__(f"{where} has no id: the generic mirror cannot keep it, and no other handler "
                         "takes this type")


def _ts(value: Any) -> datetime | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return datetime.fromtimestamp(value, tz=timezone.utc)


def _id(value: Any) -> str | None:
    """An id, whether Stripe sent it bare or expanded into an object."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, dict) and isinstance(value.get("id"), str):
        return value["id"]
    return None


def _in_object(path: str) -> str:
    if not path.startswith(_OBJECT):
        raise ValueError(f"{path} is not a path into data.object")
    return path[len(_OBJECT):]


def _first_id(obj: Obj, requirement: Requirement) -> str | None:
    """The id at the first of the requirement's paths that holds one (bare or expanded)."""
    for path in alternatives(requirement):
        value = _id(value_at(obj, _in_object(path)))
        if value is not None:
            return value
    return None


def _required_id(obj: Obj, requirement: Requirement) -> str:
    value = _first_id(obj, requirement)
    if value is None:
        raise UnmappablePayload(describe(requirement))
    return value


def _required_str(obj: Obj, path: str) -> str:
    value = value_at(obj, _in_object(path))
    if not isinstance(value, str) or not value:
        raise UnmappablePayload(path)
    return value


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _items(obj: Obj) -> list[Obj]:
    items = obj.get("items")
    data = items.get("data") if isinstance(items, dict) else None
    return [i for i in data if isinstance(i, dict)] if isinstance(data, list) else []


def _features_from_metadata(*sources: Any) -> set[str]:
    found: set[str] = set()
    for source in sources:
        metadata = source.get("metadata") if isinstance(source, dict) else None
        raw = metadata.get("features") if isinstance(metadata, dict) else None
        if isinstance(raw, str):
            found.update(f.strip() for f in raw.split(",") if f.strip())
    return found


def customer_row(obj: Obj, *, deleted: bool) -> dict[str, Any]:
    metadata = obj.get("metadata")
    return {
        "id": _required_id(obj, ID),
        "email": _str(obj.get("email")),
        "name": _str(obj.get("name")),
        "deleted": deleted or obj.get("deleted") is True,
        "metadata": dict(metadata) if isinstance(metadata, dict) else {},
    }


def subscription_row(obj: Obj, entitlements_map: Mapping[str, list[str]] | None = None) -> dict[str, Any]:
    items = _items(obj)
    first = items[0] if items else {}
    price = first.get("price") if isinstance(first.get("price"), dict) else None
    plan = obj.get("plan") if isinstance(obj.get("plan"), dict) else (
        first.get("plan") if isinstance(first.get("plan"), dict) else None)
    price_or_plan = price or plan or {}
    price_id = _id(price_or_plan)
    product_id = _id(price_or_plan.get("product"))

    # Older API versions: periods on the subscription. Newer: on each item.
    period_start = obj.get("current_period_start")
    period_end = obj.get("current_period_end")
    if period_start is None and items:
        starts = [i.get("current_period_start") for i in items if _int(i.get("current_period_start")) is not None]
        ends = [i.get("current_period_end") for i in items if _int(i.get("current_period_end")) is not None]
        period_start = min(starts) if starts else None
        period_end = max(ends) if ends else None

    features = _features_from_metadata(price, plan, price_or_plan.get("product"))
    for key in (price_id, product_id):
        if key and entitlements_map and key in entitlements_map:
            features.update(entitlements_map[key])

    quantity = _int(obj.get("quantity"))
    if quantity is None and items:
        quantity = _int(first.get("quantity"))
    return {
        "id": _required_id(obj, ID),
        "customer_id": _required_id(obj, CUSTOMER),
        "status": _required_str(obj, STATUS),
        "price_id": price_id,
        "product_id": product_id,
        "quantity": quantity,
        "cancel_at_period_end": obj.get("cancel_at_period_end") is True,
        "current_period_start": _ts(period_start),
        "current_period_end": _ts(period_end),
        "trial_end": _ts(obj.get("trial_end")),
        "canceled_at": _ts(obj.get("canceled_at")),
        "ended_at": _ts(obj.get("ended_at")),
        "features": sorted(features),
    }


def invoice_subscription_id(obj: Obj) -> str | None:
    direct = _id(obj.get("subscription"))
    if direct:
        return direct
    parent = obj.get("parent")
    details = parent.get("subscription_details") if isinstance(parent, dict) else None
    return _id(details.get("subscription")) if isinstance(details, dict) else None


def invoice_row(obj: Obj, *, deleted: bool = False) -> dict[str, Any]:
    return {
        "id": _required_id(obj, ID),
        "customer_id": _first_id(obj, CUSTOMER),
        "subscription_id": invoice_subscription_id(obj),
        "status": _str(obj.get("status")),
        "amount_due": _int(obj.get("amount_due")),
        "amount_paid": _int(obj.get("amount_paid")),
        "currency": _str(obj.get("currency")),
        "period_start": _ts(obj.get("period_start")),
        "period_end": _ts(obj.get("period_end")),
        "billing_reason": _str(obj.get("billing_reason")),
        "deleted": deleted,
    }


def checkout_session_row(obj: Obj) -> dict[str, Any]:
    return {
        "id": _required_id(obj, ID),
        "customer_id": _first_id(obj, CUSTOMER),
        "subscription_id": _id(obj.get("subscription")),
        "client_reference_id": _str(obj.get("client_reference_id")),
        "mode": _str(obj.get("mode")),
        "status": _str(obj.get("status")),
        "payment_status": _str(obj.get("payment_status")),
    }


def entitlement_summary(obj: Obj) -> tuple[str, list[str]]:
    """(customer id, active feature lookup keys) of an active entitlement summary."""
    customer = _required_id(obj, SUMMARY_CUSTOMER)
    data = value_at(obj, _in_object(SUMMARY_ENTITLEMENTS))
    if not isinstance(data, list):
        raise UnmappablePayload(SUMMARY_ENTITLEMENTS)
    features = set()
    for index, item in enumerate(data):
        key = (item.get("lookup_key") or _id(item.get("feature"))) if isinstance(item, dict) else None
        if not isinstance(key, str) or not key:
            raise UnmappablePayload(f"{SUMMARY_ENTITLEMENTS}[{index}].lookup_key")
        features.add(key)
    return customer, sorted(features)


def payment_failed_notice(obj: Obj) -> dict[str, Any]:
    """The invoice.payment_failed effect's payload: what a dunning e-mail needs, nothing more."""
    # Its own fields, not invoice_row's: the payload is a published contract (docs/outbox.md, "Built-in effects").
    return {
        "invoice_id": _required_id(obj, ID),
        "customer_id": _first_id(obj, CUSTOMER),
        "subscription_id": invoice_subscription_id(obj),
        "amount_due": _int(obj.get("amount_due")),
        "currency": _str(obj.get("currency")),
        "attempt_count": _int(obj.get("attempt_count")),
        "next_payment_attempt": _int(obj.get("next_payment_attempt")),
        "hosted_invoice_url": _str(obj.get("hosted_invoice_url")),
    }


# The generic mirror's row needs data.object.id and this, yet the mirror declares no requirement: it steps
# aside when another handler takes the type (an entitlement summary has no id), which only it can tell.
OBJECT_TYPE = "data.object.object"


def object_row(obj: Obj, *, event_type: str | None) -> dict[str, Any]:
    """The generic mirror's row of any Stripe object (billing.objects); ``data`` is the object itself.

    Raises ObjectWithoutId without a string id, UnmappablePayload without an ``object`` type."""
    object_id = value_at(obj, _in_object(ID))
    if not isinstance(object_id, str) or not object_id:
        raise ObjectWithoutId()
    return {"id": object_id, "object_type": _required_str(obj, OBJECT_TYPE), "data": obj,
            "deleted": is_deletion(event_type, obj)}
