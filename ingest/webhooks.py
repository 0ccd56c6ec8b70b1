"""POST /webhooks/stripe, /webhooks/stripe/connect and /webhooks/stripe/thin: verify, record
durably, wake a worker, answer.

The answer is 2xx only after the row is committed; nothing here does business work,
and nothing here calls Stripe's API (a thin notification is recorded as it came; the
worker fetches what it points at). Each endpoint verifies with its own secrets only:
the platform's snapshot endpoint with STRIPE_WEBHOOK_SECRET, the Connect endpoint
(connected accounts' events, each naming its ``account``) with
STRIPE_CONNECT_WEBHOOK_SECRET, the thin endpoint (event destinations' thin
notifications, of the platform or of connected accounts) with
STRIPE_THIN_WEBHOOK_SECRET, so a secret leaked from one cannot sign for another. An
event of a mode the deployment does not accept (LEDGER_ACCEPT_LIVEMODE) is answered
400 and not recorded.
"""
from __future__ import annotations

import json
import logging
import time

from flask import Blueprint, Response, abort, current_app, request

from ingest import metrics
from ledger.stripe_events import InvalidEvent, parse_event, parse_notification
from ingest.signature import InvalidSignature, verify
from ledger.errors import DatabaseUnavailable
from ledger.http import read_body

log = logging.getLogger(__name__)

bp = Blueprint("webhooks", __name__)


def _answer(http_status: int, outcome: str, started: float, **body):
    metrics.REQUESTS.labels(outcome).inc()
    metrics.LATENCY.observe(time.perf_counter() - started)
    # json.dumps over jsonify: the same bytes for these flat bodies, without Flask's JSON provider
    # machinery on every delivery.
    return Response(json.dumps({"outcome": outcome, **body}, separators=(",", ":")), status=http_status,
                    mimetype="application/json")


# Each endpoint answers 404, as if it did not exist, while its secret list is empty.

@bp.post("/webhooks/stripe")
def receive_stripe_event():
    """The platform account's snapshot endpoint (STRIPE_WEBHOOK_SECRET; a receiver of thin notifications
    only leaves it unset)."""
    return _receive("secrets", parse_event)


@bp.post("/webhooks/stripe/connect")
def receive_connect_event():
    """The Connect endpoint (STRIPE_CONNECT_WEBHOOK_SECRET)."""
    return _receive("connect_secrets", _parse_connect_event)


@bp.post("/webhooks/stripe/thin")
def receive_thin_notification():
    """The thin endpoint: event destinations with thin payloads (STRIPE_THIN_WEBHOOK_SECRET)."""
    return _receive("thin_secrets", parse_notification)


def _parse_connect_event(body: bytes):
    event = parse_event(body)
    if event.account is None:
        # Applied without it, a connected account's objects would land among the platform's.
        raise InvalidEvent("'account' is required at the Connect endpoint: it names the connected account")
    return event


def _receive(secrets_of: str, parse):
    """``secrets_of``: the LedgerExtension field of the endpoint's secrets; ``parse``: its body's parser."""
    ext = current_app.extensions["ledger"]
    secrets: tuple[str, ...] = getattr(ext, secrets_of)
    if not secrets:
        abort(404)
    started = time.perf_counter()
    body = read_body(ext.settings.max_body_bytes)  # past max_body_bytes this raises 413
    if body is None:
        return _answer(400, "incomplete_body", started,
                       error="the request body could not be read whole: it ended early or its framing is invalid")
    try:
        verify(body, request.headers.get("Stripe-Signature"), secrets, ext.settings.signature_tolerance_s)
        event = parse(body)
    except InvalidSignature as exc:
        return _answer(400, "invalid_signature", started, error=str(exc))
    except InvalidEvent as exc:
        return _answer(400, "invalid_event", started, error=str(exc))
    if not ext.settings.accepts_livemode(event.livemode):
        log.info("event of a mode this deployment does not accept; answering 400, nothing recorded",
                 extra={"event_id": event.id, "type": event.type, "livemode": event.livemode})
        return _answer(400, "livemode_not_accepted", started, event_id=event.id,
                       error=f"this deployment accepts {ext.settings.accept_livemode} mode events only "
                             "(LEDGER_ACCEPT_LIVEMODE); nothing was recorded")

    try:
        delivery = ext.store.record_delivery(event)
    except DatabaseUnavailable as exc:
        log.error("event not recorded; answering 503 so Stripe retries",
                  extra={"event_id": event.id, "type": event.type, "error_class": str(exc)})
        return _answer(503, "unavailable", started, event_id=event.id,
                       error="ledger unavailable, retry later")

    enqueued = ext.waker.wake_together(event.id) if delivery.needs_wakeup else False
    if not enqueued and delivery.needs_wakeup:
        metrics.WAKEUPS_LOST.inc()
    outcome = "received" if delivery.inserted else "duplicate"
    if not delivery.inserted:
        metrics.DUPLICATES.labels(delivery.status.value).inc()
    # DEBUG: a line per delivery costs the receiver ~100 µs; ingest_requests_total counts outcomes.
    log.debug("event recorded", extra={"event_id": event.id, "type": event.type, "outcome": outcome,
                                      "status": delivery.status.value, "enqueued": enqueued})
    return _answer(200, outcome, started, event_id=event.id, status=delivery.status.value, enqueued=enqueued)
