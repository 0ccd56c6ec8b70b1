"""The one door to the ledger: receiver, workers, sweep and CLI all go through here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from ledger.db import ProcessPool
from ledger.errors import DatabaseUnavailable
from ledger.queries import SQL
from ledger.states import EventStatus


@dataclass(frozen=True)
class IncomingEvent:
    """A verified Stripe event envelope, as the receiver records it."""
    id: str
    type: str
    created: int
    livemode: bool
    api_version: str | None
    account: str | None
    payload: str  # the verified body, exactly as sent


@dataclass(frozen=True)
class Delivery:
    """What recording one delivery did."""
    inserted: bool
    status: EventStatus
    needs_wakeup: bool


class EventStore:
    def __init__(self, pool: ProcessPool):
        self._pool = pool

    def record_delivery(self, event: IncomingEvent) -> Delivery:
        """Durably record a delivery (autocommit: committed when this returns)."""
        params = {"id": event.id, "type": event.type, "created": event.created,
                  "livemode": event.livemode, "api_version": event.api_version,
                  "account": event.account, "payload": event.payload}
        row = self._run_once_more_on_dead_connection(SQL.event_record_delivery, params)
        return Delivery(inserted=row["inserted"], status=EventStatus(row["status"]),
                        needs_wakeup=row["wake"])

    def ping(self) -> bool:
        """True if Postgres answers now."""
        try:
            with self._pool.get().connection(timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except Exception:
            return False

    def get_event(self, event_id: str) -> dict[str, Any] | None:
        with self._pool.get().connection() as conn:
            return conn.cursor(row_factory=dict_row).execute(SQL.event_get, {"id": event_id}).fetchone()

    def _run_once_more_on_dead_connection(self, sql: str, params: dict) -> dict[str, Any]:
        # After a Postgres restart every idle pooled connection is dead. Checking
        # each one before use would cost a round trip per request; instead, a
        # failure on a dead connection makes the pool check its idle ones and the
        # statement runs once more on a fresh connection.
        pool = self._pool.get()
        for last_try in (False, True):
            try:
                with pool.connection() as conn:
                    return conn.cursor(row_factory=dict_row).execute(sql, params).fetchone()
            except PoolTimeout as exc:
                # No connection could be had in time: waiting again would only double the latency.
                raise DatabaseUnavailable("Postgres unavailable: no connection within the pool timeout") from exc
            except psycopg.OperationalError as exc:
                if last_try:
                    raise DatabaseUnavailable(f"Postgres unavailable: {type(exc).__name__}") from exc
                pool.check()
            except psycopg.Error as exc:
                raise DatabaseUnavailable(f"Postgres refused the statement: {type(exc).__name__}") from exc
        raise AssertionError("unreachable")
