"""Stripe-Signature verification with the stripe library, against any configured secret."""
from __future__ import annotations

import stripe

from ledger.errors import LedgerError


class InvalidSignature(LedgerError):
    """No configured secret verifies the Stripe-Signature header."""


def verify(body: bytes, header: str | None, secrets: tuple[str, ...], tolerance_s: int) -> None:
    if not header:
        raise InvalidSignature("missing Stripe-Signature header")
    if not header.isascii():
        # Stripe's header is ASCII; the library's hmac.compare_digest raises TypeError on a non-ASCII v1 value.
        raise InvalidSignature("malformed Stripe-Signature header")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidSignature("body is not UTF-8, so it cannot carry a valid signature") from None
    reason = None
    for secret in secrets:
        try:
            stripe.WebhookSignature.verify_header(text, header, secret, tolerance_s)
            return
        except stripe.SignatureVerificationError as exc:
            # While a secret is rolled, the secret that signed a stale delivery says
            # "too old"; another secret's mismatch must not hide that.
            if reason != _OUTSIDE_TOLERANCE:
                reason = _reason(str(exc))
    raise InvalidSignature(reason)


_OUTSIDE_TOLERANCE = "signature timestamp outside the tolerance window"


def _reason(library_message: str) -> str:
    # Our own wording: the library's messages are fine today, but an error body
    # must never depend on a third party not echoing its input.
    message = library_message.lower()
    if "tolerance" in message:
        return _OUTSIDE_TOLERANCE
    # Not just "no signatures found": the library's wrong-signature message starts with that too.
    if "unable to extract" in message or "no signatures found with expected scheme" in message:
        return "malformed Stripe-Signature header"
    return "no configured secret verifies the Stripe-Signature header"
