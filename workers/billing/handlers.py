"""The built-in billing handlers, loaded like any user handler module (workers.registry).

Each runs inside the apply transaction: mapping (pure) then guarded upserts,
named SQL from workers/billing/billing.sql. ``register_handlers`` lists every
event type handled here; the load calls it with the settings, because the
subscription handler carries the entitlements map they name. Every type, typed
or not, also goes to the generic mirror (``ObjectMirror``, pattern ``*``), but
a ``v2.*`` one (workers.registry). Each registration states what its handler
requires of an event: the mapping's ``*_REQUIRES``, which its row checks too.
Objects fetched from the API take the same mapping and statements through
workers/billing/snapshots.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from psycopg.types.json import Jsonb

from ledger.config import Settings
from ledger.errors import ConfigError
from ledger.queries import load
from workers.billing import mapping
from workers.failures import PermanentError
from workers.handlers import ApplyContext, HandlerRegistry

SQL = load("workers.billing")
ENTITLEMENTS_CHANGED = "entitlements.changed"

CUSTOMER_EVENTS = ("customer.created", "customer.updated", "customer.deleted")
SUBSCRIPTION_EVENTS = ("customer.subscription.created", "customer.subscription.updated",
                       "customer.subscription.deleted", "customer.subscription.paused",
                       "customer.subscription.resumed", "customer.subscription.trial_will_end",
                       "customer.subscription.pending_update_applied",
                       "customer.subscription.pending_update_expired")
INVOICE_EVENTS = ("invoice.created", "invoice.updated", "invoice.finalized", "invoice.paid",
                  "invoice.payment_succeeded", "invoice.payment_failed", "invoice.payment_action_required",
                  "invoice.voided", "invoice.marked_uncollectible", "invoice.deleted")
CHECKOUT_EVENTS = ("checkout.session.completed",)
ENTITLEMENT_SUMMARY_EVENTS = ("entitlements.active_entitlement_summary.updated",)
MIRROR_PATTERN = "*"  # every type, these included


def register_handlers(registry: HandlerRegistry, settings: Settings) -> None:
    """Called by load_handlers. The entitlements map is read here, once per load: an
    unreadable file fails at start-up, not per event."""
    registry.handler(*CUSTOMER_EVENTS, requires=mapping.CUSTOMER_REQUIRES)(apply_customer)
    registry.handler(*SUBSCRIPTION_EVENTS, requires=mapping.SUBSCRIPTION_REQUIRES)(
        SubscriptionHandler(read_entitlements_map(settings.entitlements_map_path)))
    registry.handler(*INVOICE_EVENTS, requires=mapping.INVOICE_REQUIRES)(apply_invoice)
    registry.handler(*CHECKOUT_EVENTS, requires=mapping.CHECKOUT_SESSION_REQUIRES)(apply_checkout_session)
    registry.handler(*ENTITLEMENT_SUMMARY_EVENTS, requires=mapping.ENTITLEMENT_SUMMARY_REQUIRES)(
        apply_entitlement_summary)
    # Last of the built-ins: a typed handler's refusal (naming the field) is the one reported. It requires
    # nothing up front: what it needs (an id, an object type) it needs only when no other handler takes the type.
    registry.handler(MIRROR_PATTERN)(ObjectMirror(registry))


def _stamp(ctx: ApplyContext, row: dict) -> dict:
    return {**row, "event_id": ctx.event_id, "event_type": ctx.event_type,
            "event_created": ctx.created, "account": ctx.account, "livemode": ctx.livemode}


def read_entitlements_map(path: str | None) -> dict[str, list[str]]:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
            raise ValueError("expected an object of id -> list of feature names")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"LEDGER_ENTITLEMENTS_MAP {path}: {exc}") from None
    return {str(k): [str(f) for f in v] for k, v in data.items()}


def apply_customer(ctx: ApplyContext) -> None:
    row = mapping.customer_row(ctx.object, deleted=ctx.event_type == "customer.deleted")
    row["metadata"] = Jsonb(row["metadata"])
    ctx.conn.execute(SQL.customer_upsert_if_newer, _stamp(ctx, row))


@dataclass(frozen=True)
class SubscriptionHandler:
    """customer.subscription.*: the row and its transition, then the customer's entitlements.

    Features come from the ``features`` metadata of the price or plan, plus
    ``entitlements_map`` (price or product id -> features, LEDGER_ENTITLEMENTS_MAP).
    Handlers built from equal maps are equal: registering one twice keeps one entry.
    """
    entitlements_map: Mapping[str, list[str]] = field(default_factory=dict, hash=False)

    def __call__(self, ctx: ApplyContext) -> None:
        row = mapping.subscription_row(ctx.object, self.entitlements_map)
        before = ctx.conn.execute(SQL.subscription_lock, {"id": row["id"]}).fetchone()
        ctx.conn.execute(SQL.subscription_apply_event, {**_stamp(ctx, row), "from_status": before and before[0],
                                                        "transition": True})
        recompute_entitlements(ctx, row["customer_id"])


# Without an entitlements map: what a load without LEDGER_ENTITLEMENTS_MAP registers,
# and what another handler that applies a subscription snapshot itself calls.
apply_subscription = SubscriptionHandler()


def recompute_entitlements(ctx: ApplyContext, customer_id: str) -> None:
    """Derive subscription entitlements from current state: idempotent by construction."""
    ctx.conn.execute(SQL.entitlements_lock_customer, {"customer_id": customer_id})
    before = _features_if_announced(ctx, customer_id)
    derive_entitlements(ctx.conn, customer_id)
    _announce_if_changed(ctx, customer_id, before)


def derive_entitlements(conn, customer_id: str) -> None:
    """The customer's subscription entitlements from its subscriptions' current rows; the caller holds
    entitlements_lock_customer."""
    params = {"customer_id": customer_id}
    conn.execute(SQL.entitlements_revoke_lapsed, params)
    conn.execute(SQL.entitlements_grant_current, params)


def _features(ctx: ApplyContext, customer_id: str) -> list[str]:
    return [r[0] for r in ctx.conn.execute(SQL.entitlements_of_customer, {"customer_id": customer_id})]


def _features_if_announced(ctx: ApplyContext, customer_id: str) -> list[str] | None:
    """The set before a change, read only when entitlements.changed has a sender: otherwise
    nothing would be announced, and these reads were 2 of a subscription event's 11 round trips."""
    return _features(ctx, customer_id) if ENTITLEMENTS_CHANGED in ctx.enabled_effects else None


def _announce_if_changed(ctx: ApplyContext, customer_id: str, before: list[str] | None) -> None:
    """entitlements.changed: the customer's whole current set, so a receiver can apply the latest and drop stale ones."""
    if before is None:
        return  # no sender for entitlements.changed (see _features_if_announced)
    after = _features(ctx, customer_id)
    if after != before:
        ctx.emit(ENTITLEMENTS_CHANGED, {"customer_id": customer_id, "entitlements": after},
                 key=customer_id, ordering_key=customer_id, if_configured=True)


def apply_invoice(ctx: ApplyContext) -> None:
    row = mapping.invoice_row(ctx.object, deleted=ctx.event_type == "invoice.deleted")
    ctx.conn.execute(SQL.invoice_upsert_if_newer, _stamp(ctx, row))
    if ctx.event_type == "invoice.payment_failed":
        # A failed payment is news even if a newer invoice state arrived first: notify once per event.
        ctx.emit("invoice.payment_failed", mapping.payment_failed_notice(ctx.object),
                 ordering_key=row["customer_id"], if_configured=True)


def apply_checkout_session(ctx: ApplyContext) -> None:
    row = mapping.checkout_session_row(ctx.object)
    stamped = _stamp(ctx, row)
    ctx.conn.execute(SQL.checkout_session_upsert_if_newer, stamped)
    if row["customer_id"]:
        ctx.conn.execute(SQL.customer_insert_stub, {**stamped, "id": row["customer_id"]})


def apply_entitlement_summary(ctx: ApplyContext) -> None:
    customer_id, features = mapping.entitlement_summary(ctx.object)
    params = {"customer_id": customer_id, "features": features, "event_id": ctx.event_id,
              "event_created": ctx.created, "account": ctx.account}
    ctx.conn.execute(SQL.entitlements_lock_customer, params)
    if ctx.conn.execute(SQL.entitlement_summary_claim_if_newer, params).fetchone() is None:
        return  # a newer summary was already applied
    before = _features_if_announced(ctx, customer_id)
    ctx.conn.execute(SQL.entitlements_replace_from_stripe, params)
    ctx.conn.execute(SQL.entitlements_add_from_stripe, params)
    _announce_if_changed(ctx, customer_id, before)


@dataclass(frozen=True, eq=False)
class ObjectMirror:
    """Every event's ``data.object``, of any type, into billing.objects (the generic mirror).

    Keyed by (id, account, livemode), under the order guard of the typed tables. A type
    no other handler takes is mirrored and processed: with this registered, every type
    but ``v2.*`` (never matched by ``*``) has a handler and none ends ``unsupported_type``.
    An object the mirror cannot key (no id, no ``object`` type) is left to the type's
    other handlers (an entitlement summary has no id); when the mirror is the type's
    only handler, the event fails permanently with the reason (``object_without_id``,
    ``unmappable_payload``): which is why it declares no requirement. It asks the registry it was
    registered in, when it meets such an object, so handlers loaded after it count.
    """
    registry: HandlerRegistry

    def __call__(self, ctx: ApplyContext) -> None:
        try:
            row = mapping.object_row(ctx.object, event_type=ctx.event_type)
        except PermanentError:
            if any(other is not self for other in self.registry.resolve(ctx.event_type)):
                return
            raise
        row["data"] = Jsonb(row["data"])
        ctx.conn.execute(SQL.object_upsert_if_newer, _stamp(ctx, row))
