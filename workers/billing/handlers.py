"""The built-in billing handlers, loaded like any user handler module (workers.registry).

Each maps its event (workers/billing/mapping.py, pure) to rows of the billing tables
(workers/billing/tables.py) and hands them to ``ctx.rows``; the batch's writer applies them,
guarded by the order key, with the other events' (workers/writers.py). ``register_handlers``
lists every event type handled here; the load calls it with the settings, because the
subscription handler carries the entitlements map they name. Every type, typed or not, also
goes to the generic mirror (``ObjectMirror``, pattern ``*``), but a ``v2.*`` one
(workers.registry). Each registration states what its handler requires of an event: the
mapping's ``*_REQUIRES``, which its row checks too. Objects fetched from the API take the same
mapping and tables through workers/billing/snapshots.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ledger.config import Settings
from ledger.errors import ConfigError
from workers.billing import mapping
from workers.billing.tables import (CHECKOUT_SESSIONS, CUSTOMERS, ENTITLEMENT_SUMMARIES, ENTITLEMENTS, INVOICES, OBJECTS,
                                    SUBSCRIPTION_ENTITLEMENTS, SUBSCRIPTIONS, TRANSITIONS)
from workers.failures import PermanentError
from workers.handlers import ApplyContext, HandlerRegistry
from workers.rows import NEVER, EventRows

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
    registry.handler(*CUSTOMER_EVENTS, requires=mapping.CUSTOMER_REQUIRES, writes=[CUSTOMERS])(apply_customer)
    registry.handler(*SUBSCRIPTION_EVENTS, requires=mapping.SUBSCRIPTION_REQUIRES,
                     writes=[SUBSCRIPTIONS, TRANSITIONS, ENTITLEMENTS])(
        SubscriptionHandler(read_entitlements_map(settings.entitlements_map_path)))
    registry.handler(*INVOICE_EVENTS, requires=mapping.INVOICE_REQUIRES, writes=[INVOICES])(apply_invoice)
    registry.handler(*CHECKOUT_EVENTS, requires=mapping.CHECKOUT_SESSION_REQUIRES,
                     writes=[CHECKOUT_SESSIONS, CUSTOMERS])(apply_checkout_session)
    registry.handler(*ENTITLEMENT_SUMMARY_EVENTS, requires=mapping.ENTITLEMENT_SUMMARY_REQUIRES,
                     writes=[ENTITLEMENTS, ENTITLEMENT_SUMMARIES])(apply_entitlement_summary)
    # Last of the built-ins: a typed handler's refusal (naming the field) is the one reported. It requires
    # nothing up front: what it needs (an id, an object type) it needs only when no other handler takes the type.
    registry.handler(MIRROR_PATTERN, writes=[OBJECTS])(ObjectMirror(registry))


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
    ctx.rows.upsert(CUSTOMERS, mapping.customer_row(ctx.object, deleted=ctx.event_type == "customer.deleted"))


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
        ctx.rows.upsert(SUBSCRIPTIONS, row)
        # from_status and applied are the writer's: the row's status before this event, and whether it was newer.
        ctx.rows.append(TRANSITIONS, {
            "event_id": ctx.event_id, "event_type": ctx.event_type, "subscription_id": row["id"],
            "to_status": row["status"], "period_start": row["current_period_start"],
            "period_end": row["current_period_end"], "event_created": ctx.created, "account": ctx.account})
        track_entitlements(ctx, row["customer_id"])


# Without an entitlements map: what a load without LEDGER_ENTITLEMENTS_MAP registers,
# and what another handler that applies a subscription snapshot itself calls.
apply_subscription = SubscriptionHandler()


def track_entitlements(ctx: ApplyContext, customer_id: str) -> None:
    """The customer's subscription entitlements derived again from its subscriptions' rows once the batch's
    writes are known (once per customer per batch), and announced if they changed."""
    ctx.rows.derive(SUBSCRIPTION_ENTITLEMENTS, customer_id)
    _announce_changes(ctx, customer_id)


def _announce_changes(ctx: ApplyContext, customer_id: str) -> None:
    """entitlements.changed: the customer's whole current set, so a receiver can apply the latest and drop
    stale ones; only when it has a sender (otherwise the set before is not even read)."""
    if ENTITLEMENTS_CHANGED not in ctx.enabled_effects:
        return

    def announce(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
        features = _features(after)
        if features != _features(before):
            ctx.emit(ENTITLEMENTS_CHANGED, {"customer_id": customer_id, "entitlements": features},
                     key=customer_id, ordering_key=customer_id, if_configured=True)
    ctx.rows.on_change(ENTITLEMENTS, customer_id, announce)


def _features(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({row["feature"] for row in rows})


def apply_invoice(ctx: ApplyContext) -> None:
    row = mapping.invoice_row(ctx.object, deleted=ctx.event_type == "invoice.deleted")
    ctx.rows.upsert(INVOICES, row)
    if ctx.event_type == "invoice.payment_failed":
        # A failed payment is news even if a newer invoice state arrived first: notify once per event.
        ctx.emit("invoice.payment_failed", mapping.payment_failed_notice(ctx.object),
                 ordering_key=row["customer_id"], if_configured=True)


def apply_checkout_session(ctx: ApplyContext) -> None:
    row = mapping.checkout_session_row(ctx.object)
    ctx.rows.upsert(CHECKOUT_SESSIONS, row)
    if row["customer_id"]:
        link_customer(ctx.rows, row["customer_id"])


def link_customer(rows: EventRows, customer_id: str) -> None:
    """A customer known only by its id (from a Checkout session), of the session's account and mode. Its
    order key is the lowest there is (NEVER): any customer.* event, even one created before the session
    and delivered after it, writes the row; of two such links, the newer event's stays."""
    rows.upsert(CUSTOMERS, {"id": customer_id, "email": None, "name": None, "deleted": False, "metadata": {}},
                created=NEVER)


def apply_entitlement_summary(ctx: ApplyContext) -> None:
    customer_id, features = mapping.entitlement_summary(ctx.object)
    # Stripe's summary is the customer's whole active set; applied only if newer than the last one applied.
    ctx.rows.replace(ENTITLEMENTS, {"customer_id": customer_id, "source": "stripe"},
                     [{"feature": feature, "account": ctx.account} for feature in features],
                     guard=(ENTITLEMENT_SUMMARIES, {"customer_id": customer_id}))
    _announce_changes(ctx, customer_id)


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
        ctx.rows.upsert(OBJECTS, row)
