"""POST /webhooks/stripe: verify, record durably, wake a worker, answer.

The answer is 2xx only after the row is committed; nothing here does business work.
"""
from __future__ import annotations

import logging
import time

from flask import Blueprint, current_app, jsonify, request
from werkzeug.exceptions import RequestEntityTooLarge

from ingest import metrics
from ingest.envelope import InvalidEvent, parse_event
from ingest.signature import InvalidSignature, verify
from ledger.errors import DatabaseUnavailable

log = logging.getLogger(__name__)

bp = Blueprint("webhooks", __name__)


def _answer(http_status: int, outcome: str, started: float, **body):
    metrics.REQUESTS.labels(outcome).inc()
    metrics.LATENCY.observe(time.perf_counter() - started)
    return jsonify(outcome=outcome, **body), http_status


@bp.post("/webhooks/stripe")
def receive_stripe_event():
    started = time.perf_counter()
    ext = current_app.extensions["ledger"]
    body = request.get_data(cache=False)  # past max_body_bytes this raises 413
    if request.content_length is None and len(body) >= ext.settings.max_body_bytes \
            and request.environ["wsgi.input"].read(1):
        # A streamed (chunked) body is cut at the limit without an error: one byte more is too large.
        raise RequestEntityTooLarge()
    try:
        verify(body, request.headers.get("Stripe-Signature"), ext.secrets, ext.settings.signature_tolerance_s)
        event = parse_event(body)
    except InvalidSignature as exc:
        return _answer(400, "invalid_signature", started, error=str(exc))
    except InvalidEvent as exc:
        return _answer(400, "invalid_event", started, error=str(exc))

    try:
        delivery = ext.store.record_delivery(event)
    except DatabaseUnavailable as exc:
        log.error("event not recorded; answering 503 so Stripe retries",
                  extra={"event_id": event.id, "type": event.type, "error_class": str(exc)})
        return _answer(503, "unavailable", started, event_id=event.id,
                       error="ledger unavailable, retry later")

    enqueued = ext.waker.wake(event.id) if delivery.needs_wakeup else False
    if not enqueued and delivery.needs_wakeup:
        metrics.WAKEUPS_LOST.inc()
    outcome = "received" if delivery.inserted else "duplicate"
    if not delivery.inserted:
        metrics.DUPLICATES.labels(delivery.status.value).inc()
    log.info("event recorded", extra={"event_id": event.id, "type": event.type, "outcome": outcome,
                                      "status": delivery.status.value, "enqueued": enqueued})
    return _answer(200, outcome, started, event_id=event.id, status=delivery.status.value, enqueued=enqueued)
