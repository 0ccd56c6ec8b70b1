"""Stripe-shaped events for tests, simulations and benchmarks.

Events are built the way Stripe sends them (envelope + object snapshot), with
consistent ids and increasing ``created`` times, in either the pre-basil shape
(periods on the subscription, ``invoice.subscription``) or the basil shape
(periods on items, ``invoice.parent.subscription_details``).

Bare objects (``customer``, ``product``, ``price``, ``payment_method``, ``payment_intent``,
``charge``, ``refund``, ``dispute``) are what the Stripe API lists and retrieves, for the fake
Stripe API (devkit.stripe_api) and as ``data.object`` of events.
"""
from __future__ import annotations

import itertools
import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterator

import stripe

OLD_API = "2020-08-27"
BASIL_API = "2025-03-31.basil"


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
    """One customer's subscription lifecycle as the events Stripe would send, in order."""
    api_version: str = OLD_API
    start: int = 1_700_000_000
    price_id: str = field(default_factory=lambda: new_id("price"))
    product_id: str = field(default_factory=lambda: new_id("prod"))
    features: tuple[str, ...] = ("seats", "reports")
    customer_id: str = field(default_factory=lambda: new_id("cus"))
    subscription_id: str = field(default_factory=lambda: new_id("sub"))
    events: list[dict[str, Any]] = field(default_factory=list)
    _clock: Iterator[int] = field(init=False, repr=False)

    def __post_init__(self):
        self._clock = itertools.count(self.start, 7)

    def _subscription(self, status: str, period_start: int, *, cancel_at_period_end: bool = False,
                      trial_end: int | None = None, canceled_at: int | None = None,
                      ended_at: int | None = None) -> dict[str, Any]:
        period_end = period_start + 30 * 86400
        price = {"id": self.price_id, "object": "price", "product": self.product_id,
                 "metadata": {"features": ",".join(self.features)}, "currency": "usd", "unit_amount": 1500}
        item: dict[str, Any] = {"id": new_id("si"), "object": "subscription_item", "price": price,
                                "quantity": 1, "subscription": self.subscription_id}
        sub: dict[str, Any] = {"id": self.subscription_id, "object": "subscription",
                               "customer": self.customer_id, "status": status,
                               "cancel_at_period_end": cancel_at_period_end, "trial_end": trial_end,
                               "canceled_at": canceled_at, "ended_at": ended_at, "quantity": 1,
                               "items": {"object": "list", "data": [item]}}
        if self.api_version >= "2025-03-31":
            item["current_period_start"], item["current_period_end"] = period_start, period_end
        else:
            sub["current_period_start"], sub["current_period_end"] = period_start, period_end
            sub["plan"] = {**price, "object": "plan"}
        return sub

    def _invoice(self, status: str, amount_paid: int, period_start: int, reason: str) -> dict[str, Any]:
        inv: dict[str, Any] = {"id": new_id("in"), "object": "invoice", "customer": self.customer_id,
                               "status": status, "amount_due": 1500, "amount_paid": amount_paid,
                               "currency": "usd", "period_start": period_start,
                               "period_end": period_start + 30 * 86400, "billing_reason": reason}
        if self.api_version >= "2025-03-31":
            inv["parent"] = {"type": "subscription_details",
                             "subscription_details": {"subscription": self.subscription_id, "metadata": {}}}
        else:
            inv["subscription"] = self.subscription_id
        return inv

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
        self.add("invoice.paid", {**failed, "status": "paid", "amount_paid": 1500})
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


def incoming(evt: dict[str, Any]):
    """The ledger's view of a verified delivery of ``evt`` (for recording without HTTP)."""
    from ledger.store import IncomingEvent

    return IncomingEvent(id=evt["id"], type=evt["type"], created=evt["created"], livemode=evt["livemode"],
                         api_version=evt.get("api_version"), account=evt.get("account"), payload=body_of(evt))
