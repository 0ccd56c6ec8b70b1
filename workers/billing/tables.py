"""The billing tables as handlers write them (workers/rows.py): each one's key, the columns a handler's
row gives, and how a change applies. The tables themselves are migration 0002's and 0006's
(docs/schema.md is their contract); what is declared here is only what a writer needs to know.

Every latest-row table is keyed by the Stripe id and remembers the event that last wrote it
(source_event_id, source_event_created): an upsert applies only if its event is newer by that pair.
A row keeps the account and mode it was first written with. billing.objects is the generic mirror,
one row per object as each account sees it in each mode (account and mode are in its key).
"""
from __future__ import annotations

from typing import Any

from workers.rows import LATEST, ONCE, SET, STAMP, Chain, Derivation, Table

OWNER = ("account", "livemode")

CUSTOMERS = Table("billing.customers", LATEST, key=("id",), columns=("id", "email", "name", "deleted", "metadata"),
                  stamp=STAMP, owner=OWNER, touch="updated_at", json=frozenset({"metadata"}))

SUBSCRIPTIONS = Table(
    "billing.subscriptions", LATEST, key=("id",),
    columns=("id", "customer_id", "status", "price_id", "product_id", "quantity", "cancel_at_period_end",
             "current_period_start", "current_period_end", "trial_end", "canceled_at", "ended_at", "features"),
    stamp=STAMP, owner=OWNER, touch="updated_at")

INVOICES = Table(
    "billing.invoices", LATEST, key=("id",),
    columns=("id", "customer_id", "subscription_id", "status", "amount_due", "amount_paid", "currency",
             "period_start", "period_end", "billing_reason", "deleted"),
    stamp=STAMP, owner=OWNER, touch="updated_at")

CHECKOUT_SESSIONS = Table(
    "billing.checkout_sessions", LATEST, key=("id",),
    columns=("id", "customer_id", "subscription_id", "client_reference_id", "mode", "status", "payment_status"),
    stamp=STAMP, owner=OWNER, touch="updated_at")

# The generic mirror: the latest JSON of one object as one account sees it in one mode.
OBJECTS = Table("billing.objects", LATEST, key=("id", "account", "livemode"),
                columns=("id", "object_type", "data", "deleted"), stamp=STAMP, touch="updated_at",
                conflict="(id, (coalesce(account, '')), livemode)", json=frozenset({"data"}),
                null_is_empty=frozenset({"account"}))

# The order guard of Stripe's entitlement summaries, one per customer (no livemode column).
ENTITLEMENT_SUMMARIES = Table("billing.entitlement_summaries", LATEST, key=("customer_id",),
                              columns=("customer_id",), stamp=("account", "source_event_id", "source_event_created"),
                              owner=("account",))

# What each customer may use now: source 'subscription' derived from its active or trialing
# subscriptions, source 'stripe' Stripe's active entitlement summary. A set per (customer, source).
ENTITLEMENTS = Table("billing.entitlements", SET, key=("customer_id", "feature", "source"),
                     columns=("customer_id", "feature", "source", "account"), scope=("customer_id", "source"),
                     group="customer_id", guards=((ENTITLEMENT_SUMMARIES, {"source": "stripe"}),))

# One row per subscription event: the business history, written once per event id. from_status is the
# subscription's status before the event's upsert, applied whether that upsert was newer.
TRANSITIONS = Table(
    "billing.subscription_transitions", ONCE, key=("event_id",),
    columns=("event_id", "event_type", "subscription_id", "from_status", "to_status", "period_start", "period_end",
             "applied", "event_created", "account"),
    chain=Chain(SUBSCRIPTIONS, ref="subscription_id", column="status", before="from_status", applied="applied"),
    source="event_id")

GRANTING = ("active", "trialing")


def subscription_entitlements(customer_id: str, subscriptions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A customer's subscription entitlements: every feature an active or trialing subscription grants,
    once (of the account of the first such subscription, by id)."""
    granted: dict[str, Any] = {}
    for sub in subscriptions:
        if sub["status"] in GRANTING:
            for feature in sub["features"] or ():
                granted.setdefault(feature, sub["account"])
    return [{"feature": feature, "account": account} for feature, account in sorted(granted.items())]


SUBSCRIPTION_ENTITLEMENTS = Derivation(
    ENTITLEMENTS, SUBSCRIPTIONS, by="customer_id",
    scope=lambda customer_id: {"customer_id": customer_id, "source": "subscription"},
    rule=subscription_entitlements)

ALL = (CUSTOMERS, SUBSCRIPTIONS, INVOICES, CHECKOUT_SESSIONS, OBJECTS, ENTITLEMENT_SUMMARIES, ENTITLEMENTS,
       TRANSITIONS)
