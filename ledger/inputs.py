"""What a value from outside must be before it reaches Postgres or date arithmetic: a console query,
path segment or form field, a ledgerctl argument, a stored replay filter.

Text must be storable by Postgres (no NUL character, valid UTF-8: a lone surrogate is what Python
makes of undecodable bytes in argv) and of bounded length; a time must be one that Python can shift
by a filter's range and Postgres can store. Each check raises ``InputError`` naming the value and
why. The console answers it 400 and ledgerctl exits 2, before anything has changed.
"""
from __future__ import annotations

from datetime import datetime, timezone

from ledger.errors import LedgerError

MAX_TEXT = 255
# Stripe began in 2010; a filter's range (ledger.event_query, at most 31 days) shifted from either
# bound still fits Python's datetime (years 1..9999) and Postgres' timestamptz.
EARLIEST = datetime(1970, 1, 1, tzinfo=timezone.utc)
LATEST = datetime(9999, 1, 1, tzinfo=timezone.utc)


class InputError(LedgerError, ValueError):
    """A value from outside was refused."""


def usable(name: str, value: str) -> str:
    """``value`` if Postgres can store it as text; InputError otherwise."""
    if "\x00" in value:
        raise InputError(f"{name} contains a NUL character, which no text here may hold")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(f"{name} is not valid UTF-8 text") from None
    return value


def text(name: str, value: object, *, limit: int = MAX_TEXT) -> str:
    """``value`` as storable text of at most ``limit`` characters."""
    if not isinstance(value, str):
        raise InputError(f"{name} is text, not {type(value).__name__}")
    if len(value) > limit:
        raise InputError(f"{name} is at most {limit} characters")
    return usable(name, value)


def time(name: str, value: object) -> datetime:
    """``value`` (an ISO 8601 string or a datetime; UTC unless it says otherwise) as an aware UTC datetime
    between EARLIEST and LATEST."""
    if isinstance(value, str):
        if len(value) > 64:
            raise InputError(f"{name} is a time like 2026-12-01T10:00, not {len(value)} characters")
        try:
            value = datetime.fromisoformat(usable(name, value.strip()))
        except ValueError:
            raise InputError(f"{name} is a time like 2026-12-01T10:00 (UTC unless it says otherwise)") from None
    if not isinstance(value, datetime):
        raise InputError(f"{name} is a time, not {type(value).__name__}")
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    try:
        value = value.astimezone(timezone.utc)
    except OverflowError:  # year 1 with a positive offset, year 9999 with a negative one
        value = None
    if value is None or not EARLIEST <= value < LATEST:
        raise InputError(f"{name} is a time between {EARLIEST:%Y-%m-%d} and {LATEST:%Y-%m-%d}")
    return value
