"""The built-in billing handlers, registered like any user handler.

Each runs inside the apply transaction: mapping (pure) then guarded upserts.
"""
from __future__ import annotations

import json
from pathlib import Path

from psycopg.types.json import Jsonb

from ledger.config import Settings
from ledger.errors import ConfigError
from ledger.queries import load
from workers.billing import mapping
from workers.registry import ApplyContext, handler

SQL = load("workers.billing")
ENTITLEMENTS_CHANGED = "entitlements.changed"


def _stamp(ctx: ApplyContext, row: dict) -> dict:
    return {**row, "event_id": ctx.event_id, "event_type": ctx.event_type,
            "event_created": ctx.created, "livemode": ctx.livemode}


# Price or product id -> features it grants, from LEDGER_ENTITLEMENTS_MAP (a JSON
# file), on top of the "features" metadata of prices and plans. Set by configure().
_entitlements_map: dict[str, list[str]] = {}


def configure(settings: Settings) -> None:
    """Load the entitlements map at start-up; an unreadable file fails there, not per event."""
    global _entitlements_map
    _entitlements_map = read_entitlements_map(settings.entitlements_map_path)


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


@handler("customer.created", "customer.updated", "customer.deleted")
def apply_customer(ctx: ApplyContext) -> None:
    row = mapping.customer_row(ctx.object, deleted=ctx.event_type == "customer.deleted")
    row["metadata"] = Jsonb(row["metadata"])
    ctx.conn.execute(SQL["customer_upsert_if_newer"], _stamp(ctx, row))


@handler("customer.subscription.created", "customer.subscription.updated",
         "customer.subscription.deleted", "customer.subscription.paused",
         "customer.subscription.resumed", "customer.subscription.trial_will_end",
         "customer.subscription.pending_update_applied", "customer.subscription.pending_update_expired")
def apply_subscription(ctx: ApplyContext) -> None:
    row = mapping.subscription_row(ctx.object, _entitlements_map)
    before = ctx.conn.execute(SQL["subscription_lock"], {"id": row["id"]}).fetchone()
    ctx.conn.execute(SQL["subscription_apply_event"], {**_stamp(ctx, row), "from_status": before and before[0]})
    recompute_entitlements(ctx, row["customer_id"])


def recompute_entitlements(ctx: ApplyContext, customer_id: str) -> None:
    """Derive subscription entitlements from current state: idempotent by construction."""
    params = {"customer_id": customer_id}
    ctx.conn.execute(SQL["entitlements_lock_customer"], params)
    before = _features_if_announced(ctx, customer_id)
    ctx.conn.execute(SQL["entitlements_revoke_lapsed"], params)
    ctx.conn.execute(SQL["entitlements_grant_current"], params)
    _announce_if_changed(ctx, customer_id, before)


def _features(ctx: ApplyContext, customer_id: str) -> list[str]:
    return [r[0] for r in ctx.conn.execute(SQL["entitlements_of_customer"], {"customer_id": customer_id})]


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


@handler("invoice.created", "invoice.updated", "invoice.finalized", "invoice.paid",
         "invoice.payment_succeeded", "invoice.payment_failed", "invoice.payment_action_required",
         "invoice.voided", "invoice.marked_uncollectible", "invoice.deleted")
def apply_invoice(ctx: ApplyContext) -> None:
    row = mapping.invoice_row(ctx.object, deleted=ctx.event_type == "invoice.deleted")
    ctx.conn.execute(SQL["invoice_upsert_if_newer"], _stamp(ctx, row))
    if ctx.event_type == "invoice.payment_failed":
        # A failed payment is news even if a newer invoice state arrived first: notify once per event.
        ctx.emit("invoice.payment_failed", mapping.payment_failed_notice(ctx.object),
                 ordering_key=row["customer_id"], if_configured=True)


@handler("checkout.session.completed")
def apply_checkout_session(ctx: ApplyContext) -> None:
    row = mapping.checkout_session_row(ctx.object)
    stamped = _stamp(ctx, row)
    ctx.conn.execute(SQL["checkout_session_upsert_if_newer"], stamped)
    if row["customer_id"]:
        ctx.conn.execute(SQL["customer_insert_stub"], {**stamped, "id": row["customer_id"]})


@handler("entitlements.active_entitlement_summary.updated")
def apply_entitlement_summary(ctx: ApplyContext) -> None:
    customer_id, features = mapping.entitlement_summary(ctx.object)
    params = {"customer_id": customer_id, "features": features, "event_id": ctx.event_id,
              "event_created": ctx.created}
    ctx.conn.execute(SQL["entitlements_lock_customer"], params)
    if ctx.conn.execute(SQL["entitlement_summary_claim_if_newer"], params).fetchone() is None:
        return  # a newer summary was already applied
    before = _features_if_announced(ctx, customer_id)
    ctx.conn.execute(SQL["entitlements_replace_from_stripe"], params)
    ctx.conn.execute(SQL["entitlements_add_from_stripe"], params)
    _announce_if_changed(ctx, customer_id, before)
