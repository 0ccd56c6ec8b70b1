"""Stripe-shaped events for tests, simulations and benchmarks.

Events are built the way Stripe sends them (envelope + object snapshot), with
consistent ids and increasing ``created`` times, in either the pre-basil shape
(periods on the subscription, ``invoice.subscription``) or the basil shape
(periods on items, ``invoice.parent.subscription_details``), and from clover on with the fields
Stripe added since (``billing_mode``, ``customer_account``, invoice ``amount_overpaid``, ...).

Thin event notifications (``thin_notification``, ``thin_twin``) are what an event destination POSTs:
ids and an API path, not the object; ``v2_event`` is what ``GET /v2/core/events/{id}`` answers for
one, and ``health_event`` builds the pair for ``v2.core.health.event_generation_failure.resolved``.

Bare objects (``customer``, ``product``, ``price``, ``payment_method``, ``payment_intent``,
``charge``, ``refund``, ``dispute``) are what the Stripe API lists and retrieves, for the fake
Stripe API (devkit.stripe_api) and as ``data.object`` of events.
"""
from __future__ import annotations

import itertools
import json
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterator

import stripe

from devkit.stripe_api.resources import COLLECTIONS
from ledger.stripe_events import THIN_OBJECT
from ledger.stripe_events import HEALTH_GENERATION_FAILURE as HEALTH_EVENT_TYPE

OLD_API = "2020-08-27"
BASIL_API = "2025-03-31.basil"
CLOVER_API = "2025-09-30.clover"
DAHLIA_API = "2026-07-29.dahlia"
# Versions compare by their date part: "2025-09-30.clover" >= "2025-03-31" as strings.
_BASIL, _CLOVER, _DAHLIA = (v.partition(".")[0] for v in (BASIL_API, CLOVER_API, DAHLIA_API))


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def event(event_type: str, obj: dict[str, Any], *, created: int, event_id: str | None = None,
          api_version: str = OLD_API, livemode: bool = False, account: str | None = None,
          previous_attributes: dict | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {"object": obj}
    if previous_attributes is not None:
        data["previous_attributes"] = previous_attributes
    envelope = {"id": event_id or new_id("evt"), "object": "event", "api_version": api_version,
                "created": created, "data": data, "livemode": livemode, "pending_webhooks": 1,
                "request": {"id": None, "idempotency_key": None}, "type": event_type}
    if account:
        envelope["account"] = account
    return envelope


def body_of(evt: dict[str, Any]) -> str:
    return json.dumps(evt, separators=(",", ":"))


def sign(body: str, secret: str, timestamp: int | None = None) -> str:
    """The Stripe-Signature header Stripe would send for this body."""
    return stripe.WebhookSignature.generate_signature_header(body, secret, timestamp=timestamp)


@dataclass
class SubscriptionHistory:
    """One customer's subscription lifecycle as the events Stripe would send, in order.

    ``customer_account`` ("acct_...", clover on): an Accounts v2 customer. Its subscriptions and
    invoices carry ``customer_account`` and a null ``customer``.
    """
    api_version: str = OLD_API
    start: int = 1_700_000_000
    price_id: str = field(default_factory=lambda: new_id("price"))
    product_id: str = field(default_factory=lambda: new_id("prod"))
    features: tuple[str, ...] = ("seats", "reports")
    customer_id: str = field(default_factory=lambda: new_id("cus"))
    subscription_id: str = field(default_factory=lambda: new_id("sub"))
    customer_account: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    _clock: Iterator[int] = field(init=False, repr=False)

    def __post_init__(self):
        if self.customer_account is not None and self.api_version < _CLOVER:
            raise ValueError(f"customer_account exists from {CLOVER_API} on, not at {self.api_version}")
        self._clock = itertools.count(self.start, 7)

    def _customer_fields(self) -> dict[str, Any]:
        if self.api_version < _CLOVER:
            return {"customer": self.customer_id}
        if self.customer_account is not None:
            return {"customer": None, "customer_account": self.customer_account}
        return {"customer": self.customer_id, "customer_account": None}

    def _subscription(self, status: str, period_start: int, *, cancel_at_period_end: bool = False,
                      trial_end: int | None = None, canceled_at: int | None = None,
                      ended_at: int | None = None) -> dict[str, Any]:
        period_end = period_start + 30 * 86400
        price = {"id": self.price_id, "object": "price", "product": self.product_id,
                 "metadata": {"features": ",".join(self.features)}, "currency": "usd", "unit_amount": 1500}
        item: dict[str, Any] = {"id": new_id("si"), "object": "subscription_item", "price": price,
                                "quantity": 1, "subscription": self.subscription_id}
        sub: dict[str, Any] = {"id": self.subscription_id, "object": "subscription",
                               **self._customer_fields(), "status": status,
                               "cancel_at_period_end": cancel_at_period_end, "trial_end": trial_end,
                               "canceled_at": canceled_at, "ended_at": ended_at, "quantity": 1,
                               "items": {"object": "list", "data": [item]}}
        if self.api_version >= _BASIL:
            item["current_period_start"], item["current_period_end"] = period_start, period_end
        else:
            sub["current_period_start"], sub["current_period_end"] = period_start, period_end
            sub["plan"] = {**price, "object": "plan"}
        if self.api_version >= _CLOVER:
            # Flexible billing is what new subscriptions get from clover on.
            sub.update(billing_mode={"type": "flexible", "flexible": {}}, discounts=[], billing_thresholds=None,
                       invoice_settings={"account_tax_ids": None, "issuer": {"type": "self"}})
            item.update(discounts=[], tax_rates=[], billing_thresholds=None)
        if self.api_version >= _DAHLIA:
            sub.update(billing_schedules=[], managed_payments={"enabled": False})
        return sub

    def _invoice(self, status: str, amount_paid: int, period_start: int, reason: str) -> dict[str, Any]:
        inv: dict[str, Any] = {"id": new_id("in"), "object": "invoice", **self._customer_fields(),
                               "status": status, "amount_due": 1500, "amount_paid": amount_paid,
                               "currency": "usd", "period_start": period_start,
                               "period_end": period_start + 30 * 86400, "billing_reason": reason}
        if self.api_version >= _BASIL:
            inv["parent"] = {"type": "subscription_details",
                             "subscription_details": {"subscription": self.subscription_id, "metadata": {}}}
        else:
            inv["subscription"] = self.subscription_id
        if self.api_version >= _CLOVER:
            inv.update(amount_overpaid=0, amount_remaining=inv["amount_due"] - amount_paid, discounts=[],
                       total_taxes=[], total_pretax_credit_amounts=[])
        return inv

    @staticmethod
    def _paid(inv: dict[str, Any]) -> dict[str, Any]:
        paid = {**inv, "status": "paid", "amount_paid": inv["amount_due"]}
        if "amount_remaining" in inv:
            paid["amount_remaining"] = 0
        return paid

    def add(self, event_type: str, obj: dict[str, Any]) -> dict[str, Any]:
        evt = event(event_type, obj, created=next(self._clock), api_version=self.api_version)
        self.events.append(evt)
        return evt

    def lifecycle(self) -> "SubscriptionHistory":
        """created -> trialing -> active -> past_due -> active -> canceled, with invoices."""
        t0 = self.start
        self.add("customer.created", {"id": self.customer_id, "object": "customer",
                                      "email": f"{self.customer_id}@example.test", "metadata": {}})
        self.add("customer.subscription.created", self._subscription("trialing", t0, trial_end=t0 + 14 * 86400))
        self.add("customer.subscription.updated", self._subscription("active", t0 + 14 * 86400))
        first = self._invoice("paid", 1500, t0 + 14 * 86400, "subscription_create")
        self.add("invoice.paid", first)
        renewal = t0 + 44 * 86400
        failed = self._invoice("open", 0, renewal, "subscription_cycle")
        self.add("invoice.payment_failed", failed)
        self.add("customer.subscription.updated", self._subscription("past_due", renewal))
        self.add("invoice.paid", self._paid(failed))
        self.add("customer.subscription.updated", self._subscription("active", renewal))
        self.add("customer.subscription.updated", self._subscription("active", renewal, cancel_at_period_end=True))
        end = renewal + 30 * 86400
        self.add("customer.subscription.deleted", self._subscription("canceled", renewal, canceled_at=end,
                                                                     ended_at=end))
        return self


# -- bare objects, as the API lists and retrieves them (the shapes of Stripe's own examples, trimmed) --

def customer(*, created: int, customer_id: str | None = None, email: str | None = None, livemode: bool = False,
             metadata: dict | None = None) -> dict[str, Any]:
    customer_id = customer_id or new_id("cus")
    return {"id": customer_id, "object": "customer", "created": created,
            "email": email or f"{customer_id}@example.test", "name": None, "currency": "usd", "balance": 0,
            "delinquent": False, "livemode": livemode, "metadata": metadata or {},
            "invoice_settings": {"default_payment_method": None}}


def product(*, created: int, product_id: str | None = None, name: str = "Plan", active: bool = True,
            default_price: str | None = None, livemode: bool = False, metadata: dict | None = None) -> dict[str, Any]:
    return {"id": product_id or new_id("prod"), "object": "product", "created": created, "updated": created,
            "active": active, "name": name, "description": None, "default_price": default_price, "images": [],
            "marketing_features": [], "livemode": livemode, "metadata": metadata or {}, "shippable": None,
            "type": "service", "url": None}


def price(*, created: int, product: str, price_id: str | None = None, unit_amount: int = 1500, currency: str = "usd",
          interval: str | None = "month", lookup_key: str | None = None, active: bool = True, livemode: bool = False,
          metadata: dict | None = None) -> dict[str, Any]:
    """A recurring price (``interval`` month, year, ...) or, with ``interval=None``, a one-time price."""
    recurring = {"interval": interval, "interval_count": 1, "meter": None, "usage_type": "licensed",
                 "trial_period_days": None} if interval else None
    return {"id": price_id or new_id("price"), "object": "price", "created": created, "active": active,
            "billing_scheme": "per_unit", "currency": currency, "livemode": livemode, "lookup_key": lookup_key,
            "metadata": metadata or {}, "nickname": None, "product": product, "recurring": recurring,
            "tax_behavior": "unspecified", "type": "recurring" if interval else "one_time",
            "unit_amount": unit_amount, "unit_amount_decimal": str(unit_amount)}


def payment_method(*, created: int, customer: str | None = None, payment_method_id: str | None = None,
                   brand: str = "visa", last4: str = "4242", livemode: bool = False) -> dict[str, Any]:
    return {"id": payment_method_id or new_id("pm"), "object": "payment_method", "created": created,
            "customer": customer, "type": "card", "livemode": livemode, "metadata": {},
            "billing_details": {"address": None, "email": None, "name": None, "phone": None},
            "card": {"brand": brand, "last4": last4, "exp_month": 12, "exp_year": 2034, "funding": "credit",
                     "country": "US"}}


def payment_intent(*, created: int, amount: int = 1500, currency: str = "usd", customer: str | None = None,
                   status: str = "succeeded", latest_charge: str | None = None, payment_method: str | None = None,
                   payment_intent_id: str | None = None, livemode: bool = False,
                   metadata: dict | None = None) -> dict[str, Any]:
    received = amount if status == "succeeded" else 0
    return {"id": payment_intent_id or new_id("pi"), "object": "payment_intent", "created": created,
            "amount": amount, "amount_capturable": 0, "amount_received": received, "currency": currency,
            "customer": customer, "status": status, "latest_charge": latest_charge, "payment_method": payment_method,
            "payment_method_types": ["card"], "capture_method": "automatic", "canceled_at": None,
            "cancellation_reason": None, "last_payment_error": None, "livemode": livemode,
            "metadata": metadata or {}}


def charge(*, created: int, amount: int = 1500, currency: str = "usd", customer: str | None = None,
           payment_intent: str | None = None, payment_method: str | None = None, status: str = "succeeded",
           amount_refunded: int = 0, disputed: bool = False, charge_id: str | None = None, livemode: bool = False,
           metadata: dict | None = None) -> dict[str, Any]:
    succeeded = status == "succeeded"
    return {"id": charge_id or new_id("ch"), "object": "charge", "created": created, "amount": amount,
            "amount_captured": amount if succeeded else 0, "amount_refunded": amount_refunded,
            "captured": succeeded, "currency": currency, "customer": customer, "disputed": disputed,
            "failure_code": None if succeeded or status == "pending" else "card_declined",
            "livemode": livemode, "metadata": metadata or {}, "paid": succeeded, "payment_intent": payment_intent,
            "payment_method": payment_method, "refunded": amount_refunded >= amount, "status": status,
            "balance_transaction": new_id("txn") if succeeded else None}


def refund(*, created: int, charge: str, amount: int, currency: str = "usd", payment_intent: str | None = None,
           status: str = "succeeded", reason: str | None = None, refund_id: str | None = None,
           metadata: dict | None = None) -> dict[str, Any]:
    return {"id": refund_id or new_id("re"), "object": "refund", "created": created, "amount": amount,
            "charge": charge, "currency": currency, "payment_intent": payment_intent, "reason": reason,
            "status": status, "metadata": metadata or {}, "balance_transaction": None}


def dispute(*, created: int, charge: str, amount: int, currency: str = "usd", payment_intent: str | None = None,
            status: str = "needs_response", reason: str = "general", dispute_id: str | None = None,
            livemode: bool = False, metadata: dict | None = None) -> dict[str, Any]:
    return {"id": dispute_id or new_id("dp"), "object": "dispute", "created": created, "amount": amount,
            "charge": charge, "currency": currency, "payment_intent": payment_intent, "reason": reason,
            "status": status, "is_charge_refundable": False, "balance_transactions": [],
            "evidence_details": {"due_by": created + 7 * 86400, "has_evidence": False, "past_due": False,
                                 "submission_count": 0},
            "livemode": livemode, "metadata": metadata or {}}


# -- thin events: what an event destination POSTs, and what GET /v2/core/events/{id} answers --

# The API collection of each object type the fake serves: one list for both, so every related
# object a factory builds is one the fake can retrieve.
_API_PATHS = {collection.object_type: f"/v1/{name}" for name, collection in COLLECTIONS.items()}


def object_path(obj: dict[str, Any]) -> str:
    """The API path that retrieves ``obj`` (``/v1/subscriptions/sub_...``); ValueError for a type without one."""
    kind, object_id = obj.get("object"), obj.get("id")
    if kind not in _API_PATHS:
        raise ValueError(f"no API path retrieves an object of type {kind!r}")
    if not isinstance(object_id, str) or not object_id:
        raise ValueError(f"this {kind} has no id, so no API path retrieves it")
    return f"{_API_PATHS[kind]}/{object_id}"


def related_object(obj: dict[str, Any]) -> dict[str, str]:
    """``related_object`` of a thin notification about ``obj``."""
    return {"id": obj["id"], "type": obj["object"], "url": object_path(obj)}


def iso_time(created: float) -> str:
    """Unix seconds as a v2 time: ISO 8601 UTC to the millisecond, ``Z`` (2026-11-30T10:00:00.123Z)."""
    seconds, millis = divmod(round(created * 1000), 1000)
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + f".{millis:03d}Z"


def thin_notification(event_type: str, *, related: dict[str, Any] | None = None, created: float,
                      event_id: str | None = None, livemode: bool = False,
                      context: str | None = None) -> dict[str, Any]:
    """A thin event notification as Stripe POSTs it; ``related`` is the bare object it is about (if any),
    ``context`` the connected account (omitted when None, as Stripe does)."""
    notification: dict[str, Any] = {"id": event_id or new_id("evt"), "object": THIN_OBJECT, "type": event_type,
                                    "created": iso_time(created), "livemode": livemode}
    if context is not None:
        notification["context"] = context
    if related is not None:
        notification["related_object"] = related_object(related)
    return notification


def thin_twin(snapshot_event: dict[str, Any], *, event_id: str | None = None,
              offset_s: float = 0.25) -> dict[str, Any]:
    """The thin ``v1.<type>`` notification Stripe sends alongside ``snapshot_event`` (``offset_s`` later)."""
    return thin_notification(f"v1.{snapshot_event['type']}", related=snapshot_event["data"]["object"],
                             created=snapshot_event["created"] + offset_s, event_id=event_id,
                             livemode=snapshot_event["livemode"], context=snapshot_event.get("account"))


def v2_event(notification: dict[str, Any], *, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``GET /v2/core/events/{id}`` answers for ``notification``: its fields, ``data`` when given,
    ``changes`` and ``reason`` (null when the notification has none)."""
    answer = {**notification, "changes": notification.get("changes"), "reason": notification.get("reason")}
    if data is not None:
        answer["data"] = data
    return json.loads(json.dumps(answer))  # no dict shared with the notification


def dashboard_url(obj: dict[str, Any]) -> str:
    """Where the Dashboard shows ``obj``: what a health event's ``impact.related_object.url`` holds
    (not an API path)."""
    return "https://dashboard.stripe.com" + object_path(obj).removeprefix("/v1")


def health_event(related: dict[str, Any], *, impact_event_type: str, created: float, context: str | None = None,
                 alert_id: str | None = None, severity: str = "critical",
                 livemode: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(notification, v2 event) of Stripe failing to generate ``impact_event_type`` for ``related``.

    The notification has no ``related_object``: the object is in the v2 event's ``data.impact``,
    with a Dashboard url; ``context`` is on both the notification and the impact.
    """
    notification = thin_notification(HEALTH_EVENT_TYPE, created=created, livemode=livemode, context=context)
    impact: dict[str, Any] = {"event_type": impact_event_type, "related_object_id": related["id"],
                              "related_object": {"id": related["id"], "type": related["object"],
                                                 "url": dashboard_url(related)}}
    if context is not None:
        impact["context"] = context
    data = {"alert_id": alert_id or new_id("halert"), "grouping_key": new_id("_grouping"), "impact": impact,
            "resolved_at": notification["created"],
            "summary": "We have failed to create a notification for your Stripe account.", "severity": severity}
    return notification, v2_event(notification, data=data)


def incoming(evt: dict[str, Any]):
    """The ledger's view of a verified delivery of ``evt``, a snapshot event or a thin notification
    (for recording without HTTP)."""
    from ledger.deliveries import IncomingEvent

    from ledger.stripe_events import object_and_customer

    if evt.get("object") == THIN_OBJECT:
        # As the receiver records one: created to the millisecond, the context as the account.
        return IncomingEvent(id=evt["id"], type=evt["type"], created=datetime.fromisoformat(evt["created"]).timestamp(),
                             livemode=evt["livemode"], api_version=None, account=evt.get("context"),
                             payload=body_of(evt), object_id=(evt.get("related_object") or {}).get("id"))
    object_id, customer_id = object_and_customer((evt.get("data") or {}).get("object"))
    return IncomingEvent(id=evt["id"], type=evt["type"], created=evt["created"], livemode=evt["livemode"],
                         api_version=evt.get("api_version"), account=evt.get("account"), payload=body_of(evt),
                         object_id=object_id, customer_id=customer_id)
