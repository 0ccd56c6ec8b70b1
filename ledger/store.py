"""The one door to the ledger: receiver, workers, sweep and CLI all go through here."""
from __future__ import annotations

import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterator

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from ledger.db import ProcessPool
from ledger.errors import DatabaseUnavailable, LedgerError
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
        row = self._run(SQL.event_record_delivery, params) or self._run(SQL.event_delivery_status, params)
        status = EventStatus(row["status"])
        if status is EventStatus.FAILED_RECOVERABLE:
            self._run(SQL.event_hasten_if_recoverable, params)
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

    def get_event(self, event_id: str) -> dict[str, Any] | None:
        with self._pool.get().connection() as conn:
            return conn.cursor(row_factory=dict_row).execute(SQL.event_get, {"id": event_id}).fetchone()

    def _run(self, sql: str, params: dict) -> dict[str, Any] | None:
        """One autocommitted statement, its first row; DatabaseUnavailable if Postgres fails us.

        After a Postgres restart every idle pooled connection is dead. Checking
        each one before use would cost a round trip per request; instead, a
        failure on a dead connection makes the pool check its idle ones and the
        statement runs once more on a fresh connection.
        """
        pool = self._pool.get()
        for last_try in (False, True):
            try:
                with pool.connection() as conn:
                    cursor = conn.cursor(row_factory=dict_row).execute(sql, params)
                    return cursor.fetchone() if cursor.description else None
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


# SQLSTATE raised by ledger.lease_not_held (migration 0005) in the apply transaction's fence and finish.
LEASE_NOT_HELD = "LL001"


def _rollback_quietly(conn: psycopg.Connection) -> None:
    """Roll back after a failed apply; a dead connection is the pool's to discard, and the
    original error is the one worth raising."""
    try:
        conn.rollback()
    except psycopg.Error:
        pass


class LeaseLost(LedgerError):
    """The lease on this event was taken over by another worker; this attempt must not commit."""


@dataclass(frozen=True)
class Claim:
    """An attempt this worker owns until its lease expires."""
    event_id: str
    type: str
    attempt: int        # number in the event's history
    lease_owner: str
    payload: dict
    created: datetime
    livemode: bool
    api_version: str | None
    account: str | None
    tries: int          # attempts since the last replay: what the retry budget counts
    rescued: bool = False  # this claim took over from a worker whose lease expired


@dataclass(frozen=True)
class FailureRecord:
    """How an attempt failed and what happens next (None delay: terminal)."""
    status: EventStatus
    reason: str
    error_class: str
    error: str
    delay_s: float | None = None
    wake_scheduled: bool = False


class WorkerLedger:
    """The worker's side of the state machine: claim, apply-and-finish, fail, sweep."""

    def __init__(self, pool: ProcessPool):
        self._pool = pool

    def claim(self, event_id: str, *, worker: str, lease_s: int) -> Claim | None:
        """Compare-and-set the event to processing; None when another worker has it or it is done."""
        lease_owner = uuid.uuid4().hex
        rows = self._statement(SQL.event_claim, {"id": event_id, "worker": worker, "lease_owner": lease_owner,
                                                 "lease_s": lease_s})
        row = rows[0] if rows else None
        if row is None:
            return None
        return Claim(event_id=row["id"], type=row["type"], attempt=row["attempts"], lease_owner=lease_owner,
                     payload=row["payload"], created=row["stripe_created"], livemode=row["livemode"],
                     api_version=row["api_version"], account=row["account"], tries=row["tries"],
                     rescued=row["rescued"])

    @contextmanager
    def applying(self, claim: Claim) -> Iterator[psycopg.Connection]:
        """One transaction: fence, the caller's business writes, mark processed, COMMIT.

        Pipelined: each statement goes out as it is issued and the worker waits
        only where a handler reads a result, and once for COMMIT. A subscription
        event costs two round trips here instead of one per statement. Nothing is
        read back before COMMIT, so the fence and the finish raise LL001 when the
        lease is not ours, which aborts the transaction before COMMIT runs; that
        becomes LeaseLost. Any exception from the body rolls everything back.
        A handler that needs to catch one statement's error wraps it in
        ``conn.transaction()``: a savepoint, which waits for its statements.
        """
        keys = {"id": claim.event_id, "lease_owner": claim.lease_owner, "attempt": claim.attempt}
        with self._pool.get().connection() as conn:
            try:
                with conn.pipeline():
                    # Explicit BEGIN on the autocommit connection: a sync inside the
                    # body (a savepoint, a read) must not commit part of the work.
                    conn.execute("BEGIN")
                    conn.execute(SQL.event_lock_if_lease_held, keys)
                    yield conn
                    conn.execute(SQL.event_finish_if_lease_held, keys)
                    conn.execute("COMMIT")
                    # Leaving the pipeline is the one wait: every answer, or the first error.
            except BaseException as exc:
                _rollback_quietly(conn)
                if isinstance(exc, psycopg.Error) and exc.sqlstate == LEASE_NOT_HELD:
                    raise LeaseLost() from None
                raise

    def fail(self, claim: Claim, failure: FailureRecord) -> None:
        """Record a failed attempt; raises LeaseLost if the lease is no longer ours."""
        params = {"id": claim.event_id, "lease_owner": claim.lease_owner, "attempt": claim.attempt,
                  "status": failure.status.value, "reason": failure.reason, "error_class": failure.error_class,
                  "error": failure.error[:2000], "delay_s": failure.delay_s, "wake_scheduled": failure.wake_scheduled}
        if not self._statement(SQL.event_fail_if_lease_held, params):
            raise LeaseLost()

    def mark_lease_lost(self, claim: Claim, detail: str) -> None:
        self._statement(SQL.attempt_mark_lease_lost, {"id": claim.event_id, "attempt": claim.attempt, "error": detail})

    def take_overdue_wakeups(self, *, overdue_s: float, batch: int) -> list[str]:
        """Mark up to ``batch`` overdue events as re-driven and return their ids."""
        rows = self._statement(SQL.event_sweep_overdue_wakeups, {"overdue_s": overdue_s, "batch": batch})
        return [row["id"] for row in rows]

    def _statement(self, sql: str, params: dict) -> list[dict[str, Any]]:
        """One autocommitted transition, its rows.

        After a Postgres restart every idle pooled connection is dead; the first
        statement on one fails before reaching the server. The pool then checks
        its idle connections and the statement runs once more on a live one, so a
        restart does not cost each worker a failed claim or, worse, a failure it
        could not record (which would leave the event to wait out its lease).
        Only a broken connection is retried (a statement timeout is not), and
        only once: a second failure is Postgres being down, and is raised.
        """
        pool = self._pool.get()
        for last_try in (False, True):
            with pool.connection() as conn:
                try:
                    cursor = conn.cursor(row_factory=dict_row).execute(sql, params)
                    return cursor.fetchall() if cursor.description else []
                except psycopg.OperationalError:
                    if last_try or not conn.broken:
                        raise
            pool.check()  # the broken one went back to the pool, which discards it
        raise AssertionError("unreachable")
