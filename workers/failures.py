"""Classifying an attempt's failure where it is caught: recoverable or permanent, with a reason.

Recoverable failures are retried on our own schedule; permanent ones end the
event as failed_permanent with the reason, replayable after a fix. An error
we do not recognise is treated as recoverable: retrying a bug costs a few
attempts, while wrongly giving up on a transient fault would need a human.
Retries are bounded either way (retries_exhausted).
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from enum import StrEnum

import psycopg
from psycopg_pool import PoolTimeout

from ledger.errors import LedgerError
from workers.stripe_api import StripeApiError


class Kind(StrEnum):
    RECOVERABLE = "recoverable"
    PERMANENT = "permanent"


class TransientError(LedgerError):
    """A handler says: this attempt failed, a later one may succeed."""


class PermanentError(LedgerError):
    """A handler says: retrying this event cannot succeed."""

    reason = "rejected_by_handler"


class UnmappablePayload(PermanentError):
    """The event's object lacks a field the handler needs."""

    reason = "unmappable_payload"

    def __init__(self, field: str, problem: str = "is missing or has the wrong type"):
        super().__init__(f"{field} {problem}")
        self.field = field


@dataclass(frozen=True)
class Failure:
    kind: Kind
    reason: str
    error_class: str
    message: str
    # The other side's Retry-After (an effect's receiver, Stripe's API): a retry waits at least this long.
    retry_after_s: float | None = None


# SQLSTATE classes and codes that a later attempt can get past.
_RECOVERABLE_SQLSTATE = {
    "08": "db_connection",      # connection exception
    "40": "db_conflict",        # serialization failure, deadlock
    "53": "db_resources",       # insufficient resources
    "57P": "db_shutdown",       # admin/crash shutdown, cannot connect now
    "55P03": "db_lock_timeout",  # lock not available
    "57014": "db_timeout",      # statement timeout / query canceled
}
# Reasons that mean the session itself ended (the connection lost, the backend shut down or terminated):
# never one statement's or one event's failure, whatever was running.
SESSION_LOST = frozenset({"db_connection", "db_shutdown"})
# SQLSTATE classes that retrying the same event cannot fix.
_PERMANENT_SQLSTATE = {
    "23": "constraint_violation",
    "22": "invalid_data",
}


def classify(exc: BaseException) -> Failure:
    name = type(exc).__name__
    if isinstance(exc, PermanentError):
        return Failure(Kind.PERMANENT, exc.reason, name, str(exc))
    if isinstance(exc, TransientError):
        return Failure(Kind.RECOVERABLE, "transient", name, str(exc))
    if isinstance(exc, StripeApiError):
        return _classify_api(exc)
    if isinstance(exc, PoolTimeout):
        return Failure(Kind.RECOVERABLE, "db_unavailable", name, "no database connection in time")
    if isinstance(exc, psycopg.Error):
        return _classify_sql(exc)
    if name == "SoftTimeLimitExceeded":
        return Failure(Kind.RECOVERABLE, "time_limit", name, "attempt exceeded its soft time limit")
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)) or _is_broker_error(exc):
        return Failure(Kind.RECOVERABLE, "network", name, _where(exc))
    return Failure(Kind.RECOVERABLE, "unexpected_error", name, _where(exc))


def _where(exc: BaseException) -> str:
    """Where an unrecognised error was raised, never its message: messages of
    arbitrary exceptions quote their input, and the input here is a payload."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    if not frames:
        return f"{type(exc).__name__} (no traceback)"
    frame = frames[-1]
    return f"{type(exc).__name__} raised at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}"


def _classify_sql(exc: psycopg.Error) -> Failure:
    name = type(exc).__name__
    state = exc.sqlstate or ""
    # Names only (table, column, constraint): Postgres' own messages may quote the offending value.
    diag = exc.diag
    names = ", ".join(f"{k}={v}" for k, v in (("table", diag.table_name), ("column", diag.column_name),
                                              ("constraint", diag.constraint_name)) if v)
    message = f"SQLSTATE {state or 'none'} ({name})" + (f": {names}" if names else "")
    for prefix in sorted(_RECOVERABLE_SQLSTATE, key=len, reverse=True):
        if state.startswith(prefix):
            return Failure(Kind.RECOVERABLE, _RECOVERABLE_SQLSTATE[prefix], name, message)
    if state[:2] in _PERMANENT_SQLSTATE:
        return Failure(Kind.PERMANENT, _PERMANENT_SQLSTATE[state[:2]], name, message)
    if isinstance(exc, psycopg.DataError):  # refused before it reached the server (e.g. a NUL in a string)
        return Failure(Kind.PERMANENT, "invalid_data", name, message)
    if isinstance(exc, psycopg.OperationalError):  # connection lost: no SQLSTATE at all
        return Failure(Kind.RECOVERABLE, "db_connection", name, message)
    return Failure(Kind.RECOVERABLE, "db_error", name, message)


# Stripe's refusals of a fetch (a thin notification's object or event) that no retry can change.
_API_PERMANENT = {404: "stripe_object_not_found", 401: "stripe_api_unauthorized", 403: "stripe_api_forbidden"}


def _classify_api(exc: StripeApiError) -> Failure:
    """A call to Stripe's API (workers/stripe_api.py says which are recoverable): a 429, a 5xx, a
    timeout or a lost connection waits at least Stripe's Retry-After; a 404 or a refused key is
    permanent. The message names the path and status, never the key."""
    name = type(exc).__name__
    if exc.recoverable:
        return Failure(Kind.RECOVERABLE, f"stripe_api_{exc.reason}", name, str(exc), retry_after_s=exc.retry_after_s)
    return Failure(Kind.PERMANENT, _API_PERMANENT.get(exc.status, "stripe_api_rejected"), name, str(exc))


def _is_broker_error(exc: BaseException) -> bool:
    module = type(exc).__module__ or ""
    return module.startswith(("kombu", "redis", "amqp"))
