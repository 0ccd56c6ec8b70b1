"""Checking that a verified body is a Stripe event envelope we can record.

Pure: no IO. Errors say what is wrong without echoing any value from the body.
"""
from __future__ import annotations

import json
import re

from ledger.errors import LedgerError
from ledger.store import IncomingEvent


_EVENT_ID = re.compile(r"evt_[A-Za-z0-9_-]{1,250}")
_EVENT_TYPE = re.compile(r"[A-Za-z0-9_.:-]{1,255}")
# Free-text envelope fields we store as columns: anything printable, bounded.
_LABEL = re.compile(r"[\x20-\x7e]{1,255}")


class InvalidEvent(LedgerError):
    """The body is not a Stripe event object."""


def parse_event(body: bytes) -> IncomingEvent:
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
    event_id = data.get("id")
    if not isinstance(event_id, str) or not _EVENT_ID.fullmatch(event_id):
        raise InvalidEvent("'id' must be a Stripe event id ('evt_' followed by letters, digits, '_' or '-')")
    event_type = data.get("type")
    if not isinstance(event_type, str) or not _EVENT_TYPE.fullmatch(event_type):
        raise InvalidEvent("'type' must be a Stripe event type (letters, digits, '.', '_', ':', '-')")
    obj = (data.get("data") or {}).get("object") if isinstance(data.get("data"), dict) else None
    if not isinstance(obj, dict):
        raise InvalidEvent("'data.object' must be an object")
    created = data.get("created")
    if not isinstance(created, int) or isinstance(created, bool) or not 0 <= created < 2**37:
        raise InvalidEvent("'created' must be a Unix timestamp")
    api_version = data.get("api_version")
    account = data.get("account")
    # Postgres text cannot hold NUL: such a value would fail the INSERT on every
    # redelivery and be answered 503 (retry later) forever instead of 400.
    for name, value in (("id", event_id), ("type", event_type), ("api_version", api_version), ("account", account)):
        if isinstance(value, str) and "\x00" in value:
            raise InvalidEvent(f"'{name}' must not contain NUL characters")
    return IncomingEvent(
        id=event_id,
        type=event_type,
        created=created,
        livemode=data.get("livemode") is True,
        api_version=_label(api_version, "api_version"),
        account=_label(account, "account"),
        payload=text,
    )


def _label(value, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _LABEL.fullmatch(value):
        raise InvalidEvent(f"'{name}' must be a short printable string or null")
    return value


def _reject_constant(name: str):
    raise ValueError(name)
