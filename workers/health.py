"""Stripe's health alert ``v2.core.health.event_generation_failure.resolved``, a built-in handler.

Stripe sends it when it failed to generate an event: that event is never delivered, nor
listed by the Events API, so neither a webhook nor ``ledgerctl catchup`` can bring it. The
repair is the object's current state. workers/thin.py fetches the v2 event and the object
its ``data.impact`` names before the apply transaction; here, in it, the object is applied
as a fetched snapshot (workers/billing/snapshots.py: the same mapping and order guard as
backfill, keyed by the fetch's time, never by an event that does not exist) and the alert
is recorded in ledger.health_alerts, once per notification. After the COMMIT: one warning
log line ("stripe failed to generate an event") and ``stripe_health_alerts_total``, both
for operators to alert on (docs/destinations.md, "Health alerts").

An object of a type the worker cannot retrieve, or one Stripe no longer has, is recorded
with that repair (``unsupported_object_type``, ``object_not_found``) and the event is
processed: the alert is the operator's to act on, retrying cannot change it.
"""
from __future__ import annotations

import logging
from datetime import datetime

from ledger.attempts import WorkerLedger
from ledger.stripe_events import HEALTH_GENERATION_FAILURE
from workers import metrics
from workers.billing.snapshots import apply_object
from workers.handlers import ApplyContext, handler

log = logging.getLogger(__name__)


@handler(HEALTH_GENERATION_FAILURE, requires=("data.impact",))
def apply_generation_failure(ctx: ApplyContext) -> None:
    data = ctx.event.get("data") or {}
    impact = data.get("impact") or {}
    related = impact.get("related_object") or {}
    fetched = ctx.event.get("fetched") or {}
    obj = fetched.get("object")
    if obj is not None:
        apply_object(ctx.conn, obj, fetched_at=fetched["fetched_at"], account=fetched.get("account"),
                     livemode=ctx.livemode)
    alert = {"event_id": ctx.event_id, "alert_id": _text(data.get("alert_id")),
             "failed_event_type": _text(impact.get("event_type")), "related_object_type": _text(related.get("type")),
             "related_object_id": _text(related.get("id") or impact.get("related_object_id")),
             "account": fetched.get("account"), "livemode": ctx.livemode, "severity": _text(data.get("severity")),
             "summary": _text(data.get("summary")), "resolved_at": _time(data.get("resolved_at")),
             "repair": fetched.get("outcome") or "unsupported_object_type"}
    if WorkerLedger.record_health_alert(ctx.conn, alert):
        ctx.on_commit(lambda: _announce(alert))


def _announce(alert: dict) -> None:
    metrics.HEALTH_ALERTS.labels(alert["failed_event_type"] or "unknown", alert["repair"]).inc()
    log.warning("stripe failed to generate an event (health alert recorded)",
                extra={"event_id": alert["event_id"], "alert_id": alert["alert_id"],
                       "failed_event_type": alert["failed_event_type"],
                       "related_object_type": alert["related_object_type"],
                       "related_object_id": alert["related_object_id"], "account": alert["account"],
                       "repair": alert["repair"]})


def _text(value) -> str | None:
    return value[:255] if isinstance(value, str) else None


def _time(value) -> datetime | None:
    try:
        return datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None
