"""The receiver's side of the ledger: recording a delivery (EventStore).

Its statements are named SQL (ledger/sql/events.sql), each run through ledger.statements
and its one retry rule; every failure to record is DatabaseUnavailable, answered 503 so that
Stripe retries. The worker's side is ledger.attempts, the operator's ledger.operator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from ledger.db import ProcessPool
from ledger.errors import DatabaseUnavailable
from ledger.queries import SQL
from ledger.states import EventStatus
from ledger.statements import run_statement


@dataclass(frozen=True)
class IncomingEvent:
    """A verified Stripe event envelope (a snapshot event, or a thin event notification), as the
    receiver records it."""
    id: str
    type: str
    created: float  # unix seconds: whole for snapshot events, to the millisecond for thin notifications
    livemode: bool
    api_version: str | None
    account: str | None
    payload: str  # the verified body, exactly as sent
    # Who delivered it: Stripe's webhook, or a catch-up that listed it from the API.
    source: str = "webhook"
    # The Stripe object it is about and that object's customer (ledger.stripe_events.object_and_customer):
    # what finds an object's events, and what keeps a customer's events together in a rebuild's parts.
    object_id: str | None = None
    customer_id: str | None = None


@dataclass(frozen=True)
class Delivery:
    """What recording one delivery did."""
    inserted: bool
    status: EventStatus
    needs_wakeup: bool


class EventStore:
    """The receiver's side: every failure to record is DatabaseUnavailable (answered 503, Stripe retries)."""

    def __init__(self, pool: ProcessPool):
        self._pool = pool

    def record_delivery(self, event: IncomingEvent) -> Delivery:
        """Durably record a delivery (autocommit: committed when this returns)."""
        params = {"id": event.id, "type": event.type, "created": event.created,
                  "livemode": event.livemode, "api_version": event.api_version,
                  "account": event.account, "payload": event.payload, "source": event.source,
                  "object_id": event.object_id, "customer_id": event.customer_id}
        row = (self._rows(SQL.event_record_delivery, params) or self._rows(SQL.event_delivery_status, params))[0]
        status = EventStatus(row["status"])
        if status is EventStatus.FAILED_RECOVERABLE:
            self._rows(SQL.event_hasten_if_recoverable, params)
        needs_wakeup = status in (EventStatus.RECEIVED, EventStatus.FAILED_RECOVERABLE) or (
            status is EventStatus.PROCESSING and row["lease_expired"])
        return Delivery(inserted=row["inserted"], status=status, needs_wakeup=needs_wakeup)

    def ping(self) -> bool:
        """True if Postgres answers now."""
        try:
            with self._pool.get().connection(timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except Exception:
            return False

    def _rows(self, sql: str, params: dict) -> list[dict[str, Any]]:
        """run_statement (a broken connection is retried once), its failures as DatabaseUnavailable."""
        try:
            return run_statement(self._pool, sql, params)
        except PoolTimeout as exc:
            # No connection could be had in time: waiting again would only double the latency.
            raise DatabaseUnavailable("Postgres unavailable: no connection within the pool timeout") from exc
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"Postgres unavailable: {type(exc).__name__}") from exc
        except psycopg.Error as exc:
            raise DatabaseUnavailable(f"Postgres refused the statement: {type(exc).__name__}") from exc
