"""Delivering recorded effects: senders by effect name, and the built-in webhook sender.

A handler declares an effect (``ctx.emit("entitlements.changed", {...})``)
without knowing how it is delivered; a sender registered for that name delivers
it. Built-in: an HTTP POST to OUTBOX_WEBHOOK_URL for ``entitlements.changed``
and ``invoice.payment_failed``. Plug your own with an entry point in the group
``stripe_ledger.effects`` whose name is the effect and whose value is a factory
``(settings) -> sender``; a sender is ``sender(delivery: EffectDelivery) -> None``
that raises ``DeliveryFailed`` (or any exception: recoverable) and must pass
``delivery.idempotency_key`` to the outside system (e.g. Stripe's
``idempotency_key=``), so that at-least-once delivery applies once there.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

from ledger.config import Settings
from ledger.errors import LedgerError

ENTRY_POINT_GROUP = "stripe_ledger.effects"
BUILT_IN_EFFECTS = ("entitlements.changed", "invoice.payment_failed")


@dataclass(frozen=True)
class EffectDelivery:
    sequence: int  # the outbox id: increases in commit order within an ordering key
    idempotency_key: str
    effect: str
    event_id: str
    ordering_key: str | None
    payload: dict[str, Any]


class DeliveryFailed(LedgerError):
    """The receiving side did not take the effect."""

    def __init__(self, message: str, *, permanent: bool, reason: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.permanent = permanent
        self.reason = reason
        self.retry_after_s = retry_after_s


Sender = Callable[[EffectDelivery], None]


def sign(body: bytes, secret: str, timestamp: int | None = None) -> str:
    """``t=<unix>,v1=<hex hmac-sha256 of "t.body">`` — Stripe's scheme, so backends can reuse their verifier."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a new destination: following a 301/302/303 would re-send as a GET
    without the body, and a 2xx from there would count as delivered. Refused, it is an HTTPError."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


@dataclass(frozen=True)
class WebhookSender:
    url: str
    secret: str
    timeout_s: float

    def __call__(self, delivery: EffectDelivery) -> None:
        body = json.dumps({"id": delivery.idempotency_key, "type": delivery.effect, "sequence": delivery.sequence,
                           "ordering_key": delivery.ordering_key, "event_id": delivery.event_id,
                           "data": delivery.payload}, separators=(",", ":"), sort_keys=True).encode()
        request = urllib.request.Request(self.url, data=body, method="POST", headers={
            "Content-Type": "application/json", "Idempotency-Key": delivery.idempotency_key,
            "Ledger-Signature": sign(body, self.secret), "User-Agent": "stripe-ledger-outbox"})
        try:
            with _OPENER.open(request, timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            raise _classify_status(exc.code, exc.headers.get("Retry-After")) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise DeliveryFailed(f"endpoint unreachable: {type(reason).__name__}", permanent=False,
                                 reason="network") from None


def _classify_status(status: int, retry_after: str | None) -> DeliveryFailed:
    if status == 429:
        return DeliveryFailed("HTTP 429", permanent=False, reason="rate_limited",
                              retry_after_s=_retry_after_s(retry_after))
    if status in (408, 409) or status >= 500:
        return DeliveryFailed(f"HTTP {status}", permanent=False, reason=f"http_{status}")
    return DeliveryFailed(f"HTTP {status}", permanent=True, reason=f"rejected_http_{status}")


def _retry_after_s(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None  # an HTTP-date: fall back to our own backoff


def load_senders(settings: Settings) -> dict[str, Sender]:
    senders: dict[str, Sender] = {}
    if settings.outbox_webhook_url and settings.outbox_webhook_secret:
        webhook = WebhookSender(settings.outbox_webhook_url, settings.outbox_webhook_secret,
                                settings.outbox_timeout_s)
        senders.update({name: webhook for name in BUILT_IN_EFFECTS})
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        senders[ep.name] = ep.load()(settings)
    return senders
