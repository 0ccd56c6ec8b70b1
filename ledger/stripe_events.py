"""What a Stripe event looks like: checking that a verified body is a Stripe event we can
record, a snapshot event (``parse_event``) or a thin event notification (``parse_notification``),
and the rules of its type: a thin notification's (``is_thin``), the v1 thin type and the
snapshot type its handlers take (``handler_type``), the v2 namespace (``is_v2``), Stripe's
health alert, and what a deletion is (``is_deletion``). The receiver, the workers and the
operator CLI read the same shapes: it sits in ledger/, below all of them.

Pure: no IO (parsing a notification makes no API call). Errors say what is wrong
without echoing any value from the body.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any, Mapping

import stripe
from stripe.v2.core import EventNotification

from ledger.errors import LedgerError
from ledger.deliveries import IncomingEvent


_EVENT_ID = re.compile(r"evt_[A-Za-z0-9_-]{1,250}")
_EVENT_TYPE = re.compile(r"[A-Za-z0-9_.:-]{1,255}")
# Free-text envelope fields we store as columns: anything printable, bounded.
_LABEL = re.compile(r"[\x20-\x7e]{1,255}")
# What a worker GETs for a v1 thin notification: a path under /v1/ on the configured API base, never
# a host of the body's choosing.
_API_PATH = re.compile(r"/v1/[A-Za-z0-9_]+(?:/[A-Za-z0-9_.-]+)+")
# The ``object`` of a thin notification (and of the v2 event it points at).
THIN_OBJECT = "v2.core.event"
# A thin notification of a v1 object change: ``v1.<the snapshot type>``, with a related_object.
V1_PREFIX = "v1."
# Events of Stripe's v2 namespace carry no v1 object: only handlers of that namespace take them.
V2_PREFIX = "v2."
# Stripe failed to generate an event (it is never delivered nor listed); data.impact names the object.
HEALTH_GENERATION_FAILURE = "v2.core.health.event_generation_failure.resolved"
# The one *.deleted type whose object still exists at Stripe: a canceled subscription
# (status canceled) that the API keeps returning.
_NOT_A_DELETION = frozenset({"customer.subscription.deleted"})


class InvalidEvent(LedgerError):
    """The body is not a Stripe event object."""


def is_thin(payload: Mapping[str, Any]) -> bool:
    """A recorded payload that is a thin notification: the worker fetches what it points at."""
    return payload.get("object") == THIN_OBJECT


def handler_type(event_type: str) -> str:
    """The type whose handlers apply an event: a v1 thin notification's snapshot type, else its own."""
    return event_type.removeprefix(V1_PREFIX)


def is_v2(event_type: str) -> bool:
    return event_type.startswith(V2_PREFIX)


def is_deletion(event_type: str | None, obj: Mapping[str, Any]) -> bool:
    """Whether the object is gone at Stripe: a *.deleted event, or an object that says so."""
    return obj.get("deleted") is True or (
        event_type is not None and event_type.endswith(".deleted") and event_type not in _NOT_A_DELETION)


def object_and_customer(obj: Any) -> tuple[str | None, str | None]:
    """The id of the Stripe object an event is about, and of that object's customer: ``customer`` (bare or
    expanded), else an Accounts v2 customer's ``customer_account``. None where it names none, or names it
    in a shape no id has (a recording never fails for these). The rule of ledger.reprojection_key."""
    if not isinstance(obj, dict):
        return None, None
    customer = obj.get("customer")
    if isinstance(customer, dict):
        customer = customer.get("id")
    if not isinstance(customer, str):
        customer = obj.get("customer_account")
    return _key(obj.get("id")), _key(customer)


def _key(value: Any) -> str | None:
    return value if isinstance(value, str) and _LABEL.fullmatch(value) else None


def parse_event(body: bytes) -> IncomingEvent:
    """A snapshot event (``"object": "event"``, its object in ``data.object``)."""
    text, data = _json_object(body)
    if data.get("object") == THIN_OBJECT:
        raise InvalidEvent("this is a thin event notification: its event destination belongs at "
                           "/webhooks/stripe/thin")
    event_id, event_type = _id_and_type(data)
    obj = (data.get("data") or {}).get("object") if isinstance(data.get("data"), dict) else None
    if not isinstance(obj, dict):
        raise InvalidEvent("'data.object' must be an object")
    created = data.get("created")
    if not isinstance(created, int) or isinstance(created, bool) or not 0 <= created < 2**37:
        raise InvalidEvent("'created' must be a Unix timestamp")
    api_version = data.get("api_version")
    account = data.get("account")
    _no_nul(api_version=api_version, account=account)
    object_id, customer_id = object_and_customer(obj)
    return IncomingEvent(
        id=event_id,
        type=event_type,
        created=created,
        livemode=data.get("livemode") is True,
        api_version=_label(api_version, "api_version"),
        account=_label(account, "account"),
        payload=text,
        object_id=object_id,
        customer_id=customer_id,
    )


# The stripe library's own parser of notifications. It makes no call (the receiver has no API key):
# the key is only there because a client needs one.
_NOTIFICATIONS = stripe.StripeClient("receiver-parses-only")
_NOT_A_NOTIFICATION = ("body is not a Stripe thin event notification "
                       "(object 'v2.core.event' with id, type, created and livemode)")


def parse_notification(body: bytes) -> IncomingEvent:
    """A thin event notification (``"object": "v2.core.event"``): ids, not objects; the worker fetches
    what it points at. Recorded under its own id with ``created`` to the millisecond and ``context``
    (a connected account) as the account. A ``v1.*`` type must say which object changed
    (``related_object``); any other type is recorded as it is (the worker decides what it supports)."""
    text, data = _json_object(body)
    if data.get("object") == "event":
        raise InvalidEvent("this is a snapshot event: its endpoint belongs at /webhooks/stripe")
    if data.get("object") != THIN_OBJECT:
        # Checked here: the library lets a null object through.
        raise InvalidEvent(_NOT_A_NOTIFICATION)
    event_id, event_type = _id_and_type(data)
    # Our own checks first, so the most likely mistakes get their own reason rather than the library's
    # refusal (its class of a v1 type reads related_object too).
    created = _iso_seconds(data.get("created"))
    if event_type.startswith(V1_PREFIX):
        _related_object(data.get("related_object"))
    context = data.get("context")
    _no_nul(context=context)
    account = _label(context, "context")
    try:
        # The library's checks of the envelope (its object, the fields its class of this type reads), on
        # the very object we record: parse_event_notification_without_verification would first take the
        # notification out of a cloud provider's envelope ('detail', or 'data' next to 'specversion'),
        # so a body that is no notification could pass by carrying one.
        EventNotification.from_json(data, _NOTIFICATIONS)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise InvalidEvent(_NOT_A_NOTIFICATION) from None
    related = data.get("related_object")
    return IncomingEvent(id=event_id, type=event_type, created=created, livemode=data.get("livemode") is True,
                         api_version=None, account=account, payload=text,
                         object_id=_key(related.get("id")) if isinstance(related, dict) else None)


def _json_object(body: bytes) -> tuple[str, dict]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidEvent("body is not UTF-8") from None
    try:
        # strict JSON: Postgres' json type rejects NaN/Infinity, so must we.
        data = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise InvalidEvent("body is not valid JSON") from None
    if not isinstance(data, dict):
        raise InvalidEvent("body is not a JSON object")
    return text, data


def _id_and_type(data: dict) -> tuple[str, str]:
    event_id = data.get("id")
    if not isinstance(event_id, str) or not _EVENT_ID.fullmatch(event_id):
        raise InvalidEvent("'id' must be a Stripe event id ('evt_' followed by letters, digits, '_' or '-')")
    event_type = data.get("type")
    if not isinstance(event_type, str) or not _EVENT_TYPE.fullmatch(event_type):
        raise InvalidEvent("'type' must be a Stripe event type (letters, digits, '.', '_', ':', '-')")
    return event_id, event_type


def _no_nul(**values) -> None:
    # Postgres text cannot hold NUL: such a value would fail the INSERT on every
    # redelivery and be answered 503 (retry later) forever instead of 400.
    for name, value in values.items():
        if isinstance(value, str) and "\x00" in value:
            raise InvalidEvent(f"'{name}' must not contain NUL characters")


def _iso_seconds(value) -> float:
    """A thin notification's ``created`` (ISO 8601 with a zone, e.g. 2026-11-30T10:00:00.123Z) in unix seconds."""
    try:
        when = datetime.fromisoformat(value) if isinstance(value, str) and len(value) <= 64 else None
    except ValueError:
        when = None
    if when is None or when.tzinfo is None or not 0 <= when.timestamp() < 2**37:
        raise InvalidEvent("'created' must be an ISO 8601 time with its zone (e.g. 2026-11-30T10:00:00.000Z)")
    return when.timestamp()


def _related_object(value) -> None:
    if not isinstance(value, dict) or not all(isinstance(value.get(k), str) for k in ("id", "type", "url")):
        raise InvalidEvent("'related_object' (id, type, url) is required in a v1.* thin event notification")
    url = value["url"]
    # Dot segments too: the HTTP client removes them before sending ('/v1/customers/.' would GET the list).
    if not _API_PATH.fullmatch(url) or ".." in url or "." in url.split("/"):
        raise InvalidEvent("'related_object.url' must be a Stripe API path under /v1/")


def _label(value, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _LABEL.fullmatch(value):
        raise InvalidEvent(f"'{name}' must be a short printable string or null")
    return value


def _reject_constant(name: str):
    raise ValueError(name)
