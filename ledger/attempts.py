"""The worker's side of the ledger: claim, apply-and-finish, fail, sweep, rescue (WorkerLedger).

Statements are named SQL (ledger/sql/events.sql; objects.sql, liveness.sql and thin.sql for
what an apply transaction locks, holds and records), each run through ledger.statements and
its one retry rule, except those of an apply transaction (ApplyTransaction, a savepoint per
event; SetApplyTransaction, the set-based one): it holds one connection from BEGIN to COMMIT
and is never retried (a failed attempt is recorded and retried on the event's own schedule). The receiver's side is ledger.deliveries,
the operator's ledger.operator, the outbox's ledger.outbox.
"""
from __future__ import annotations

import time
import uuid
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable, Iterator, Sequence

import psycopg
from psycopg.types.json import Json

from ledger.db import ProcessPool
from ledger.errors import LeaseLost, LedgerError
from ledger.liveness import Liveness, Probe, probe
from ledger.queries import SQL
from ledger.states import EventStatus, OutboxStatus
from ledger.statements import run_statement


# SQLSTATE raised by ledger.lease_not_held (migration 0005) in the apply transaction's fence and finish.
LEASE_NOT_HELD = "LL001"
# ApplyTransaction.lock: the longest one wait for an object key holds the earlier keys (then they are let
# go of, and the set waited for again), and the longest the whole wait goes on (then the members fail,
# recoverably). A healthy holder commits in well under a second.
OBJECT_WAIT_MS = 2000
OBJECT_LOCK_BUDGET_S = 30.0


@contextmanager
def _unprepared(conn: psycopg.Connection) -> Iterator[None]:
    """No server-side prepared statements on ``conn`` meanwhile. In a pipelined batch, a member rolled
    back to its savepoint after a deadlock made psycopg's cache of prepared statements disagree with
    the server's: every later member of that batch failed with InvalidSqlStatementName (ops/bench
    steady logged runs of 20 and more after one deadlock). Unprepared, each statement is parsed again
    (docs/benchmarks.md measures what that costs)."""
    threshold = conn.prepare_threshold
    conn.prepare_threshold = None
    try:
        yield
    finally:
        conn.prepare_threshold = threshold


class BatchLost(LedgerError):
    """The batch's transaction is gone (its connection broke): nothing of the batch commits."""


def _rollback_quietly(conn: psycopg.Connection) -> None:
    """Roll back after a failed apply; a dead connection is the pool's to discard, and the
    original error is the one worth raising."""
    try:
        conn.rollback()
    except psycopg.Error:
        pass


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
    liveness_key: int | None = None  # the claiming process's (ledger/liveness.py); None: its lease alone


@dataclass(frozen=True)
class FailureRecord:
    """How an attempt failed and what happens next (None delay: terminal); for an event or an effect."""
    status: EventStatus | OutboxStatus
    reason: str
    error_class: str
    error: str
    delay_s: float | None = None
    wake_scheduled: bool = False


class WorkerLedger:
    """The worker's side of the state machine: claim, apply-and-finish, fail, sweep, rescue."""

    def __init__(self, pool: ProcessPool, *, liveness: Liveness | None = None):
        self._pool = pool
        # The worker process's proof of life (ledger/liveness.py), stamped on its claims.
        self._liveness = liveness

    def claim(self, event_ids: Sequence[str], *, worker: str, lease_s: int) -> list[Claim]:
        """One compare-and-set for the events of one attempt (one lease owner for all): the claims,
        in the order of ``event_ids``; an id another worker has, that is done, not due, or locked
        right now (see event_claim) has none."""
        lease_owner = uuid.uuid4().hex
        rows = run_statement(self._pool, SQL.event_claim, {
            "ids": list(event_ids), "worker": worker, "lease_owner": lease_owner, "lease_s": lease_s,
            "liveness_key": self._liveness.key() if self._liveness else None})
        claims = {row["id"]: _claim(row, lease_owner) for row in rows}
        return [claims[event_id] for event_id in dict.fromkeys(event_ids) if event_id in claims]

    @contextmanager
    def applying(self, claims: Iterable[Claim] = ()) -> Iterator["ApplyTransaction"]:
        """One transaction for the claims of an attempt (one, or a batch): each applied in a
        savepoint of its own (``ApplyTransaction.member``: fence, the caller's business writes,
        finish), one COMMIT for all of them when the body returns. It holds the claims' liveness
        keys (liveness_hold_for_transaction) until it ends: its worker counts as alive meanwhile.

        Pipelined: each statement goes out as it is issued, and the worker waits only where
        a handler reads a result, once per member, and once for COMMIT. An exception out of
        the body (a member's error is raised inside it, so only what the caller lets through)
        rolls the whole transaction back; so does a failed COMMIT, whose error is raised.
        """
        with self._transaction(claims, prepared=False) as (conn, pipeline):
            yield ApplyTransaction(conn, pipeline)

    @contextmanager
    def applying_together(self, claims: Sequence[Claim]) -> Iterator["SetApplyTransaction"]:
        """The set-based apply transaction for the claims of an attempt: one fence for all of them
        (``SetApplyTransaction.held``), each applied in turn with no savepoint of its own, one finish
        for every member applied and one COMMIT when the body returns. Its statements are prepared.

        It has no way to fail one member alone: any error (a member's, the finish's, the COMMIT's) rolls
        the whole transaction back and is raised; the caller records a member's failure and applies the
        others again, or applies them all one savepoint each (``applying``). The connection is closed
        then, not put back: a pipeline aborted part-way leaves psycopg's cache of prepared statements
        disagreeing with the server's (see ``_unprepared``), and a new connection costs less than that doubt."""
        with self._transaction(claims, prepared=True) as (conn, pipeline):
            tx = SetApplyTransaction(conn, pipeline, claims)
            yield tx
            tx.finish()

    @contextmanager
    def _transaction(self, claims: Iterable[Claim], *,
                     prepared: bool) -> Iterator[tuple[psycopg.Connection, psycopg.Pipeline]]:
        """BEGIN, the claims' liveness keys held (liveness_hold_for_transaction), the body, COMMIT; rolled back
        on any exception, raised. ``prepared``: psycopg prepares statements as it does by default, and the
        connection is closed after a failure (see ``applying_together``); else nothing is prepared."""
        with self._pool.get().connection() as conn, (nullcontext() if prepared else _unprepared(conn)):
            try:
                with conn.pipeline() as pipeline:
                    conn.execute("BEGIN")
                    keys = sorted({claim.liveness_key for claim in claims} - {None})
                    if keys:
                        conn.execute(SQL.liveness_hold_for_transaction, {"keys": keys})
                    yield conn, pipeline
                    conn.execute("COMMIT")
            except BaseException:
                _rollback_quietly(conn)
                if prepared:
                    conn.close()
                raise

    def fail(self, claim: Claim, failure: FailureRecord) -> None:
        """Record a failed attempt; raises LeaseLost if the lease is no longer ours."""
        params = {**_keys(claim), "status": failure.status.value, "reason": failure.reason,
                  "error_class": failure.error_class, "error": failure.error[:2000], "delay_s": failure.delay_s,
                  "wake_scheduled": failure.wake_scheduled}
        if not run_statement(self._pool, SQL.event_fail_if_lease_held, params):
            raise LeaseLost()

    @staticmethod
    def record_snapshot_twin(conn: psycopg.Connection, event_id: str, snapshot_event_id: str) -> None:
        """In the apply transaction (``conn``): the thin notification ``event_id`` is applied under the id
        of its snapshot twin (event_record_snapshot_twin)."""
        conn.execute(SQL.event_record_snapshot_twin, {"event_id": event_id, "snapshot_event_id": snapshot_event_id})

    @staticmethod
    def lock_objects(conn: psycopg.Connection, keys: Iterable[str]) -> None:
        """In the caller's transaction: wait for the object keys, all of them, in the one global order
        (object_lock): what a write of billing rows outside a worker's batch (a fetched object) takes
        first, so that it and a worker's batch writing the same customer's rows go one after the other."""
        wanted = sorted(set(keys))
        if wanted:
            conn.execute(SQL.object_lock, {"keys": wanted}).fetchall()

    @staticmethod
    def record_applied_object(conn: psycopg.Connection, claim: Claim, obj: dict[str, Any], *, fetched_at: datetime,
                              api_version: str | None, applied_as: str | None) -> None:
        """In the apply transaction (``conn``): what the thin notification was applied as
        (event_record_applied_object)."""
        conn.execute(SQL.event_record_applied_object, {
            "event_id": claim.event_id, "created": claim.created, "object": Json(obj), "fetched_at": fetched_at,
            "api_version": api_version, "applied_as": applied_as})

    @staticmethod
    def record_health_alert(conn: psycopg.Connection, alert: dict[str, Any]) -> bool:
        """In the apply transaction (``conn``): Stripe's health alert and its repair (health_alert_record).
        False when an earlier attempt of the same notification recorded it."""
        return conn.execute(SQL.health_alert_record, alert).fetchone() is not None

    def mark_lease_lost(self, claim: Claim, detail: str) -> None:
        run_statement(self._pool, SQL.attempt_mark_lease_lost,
                      {**_keys(claim), "error": detail})

    def end_sessions_of_expired_leases(self) -> list[int]:
        """End the sessions (a stopped worker's) that still hold the liveness keys of leases that ran out,
        so the next claims can take their rows; the pids ended."""
        keys = [row["key"] for row in run_statement(self._pool, SQL.liveness_keys_of_expired_leases)]
        if not keys:
            return []
        return [row["pid"] for row in run_statement(self._pool, SQL.liveness_end_sessions, {"keys": keys})
                if row["ended"]]

    def rescue_owners_gone(self) -> Probe:
        """Take over the leases of events whose worker is gone (event_rescue_if_owner_gone): each probed
        key's liveness, and each event rescued with its key and how long its attempt had run."""
        return probe(run_statement(self._pool, SQL.event_rescue_if_owner_gone), "event_id")

    def take_overdue_wakeups(self, *, overdue_s: float, batch: int) -> list[str]:
        """Mark up to ``batch`` overdue events as re-driven and return their ids."""
        rows = run_statement(self._pool, SQL.event_sweep_overdue_wakeups, {"overdue_s": overdue_s, "batch": batch})
        return [row["id"] for row in rows]


def _keys(claim: Claim) -> dict[str, Any]:
    """What a claimed event's statements name it and its attempt by: its whole key (id, stripe_created),
    so that a partitioned ledger reads the event's month alone, the lease that fences it, the attempt."""
    return {"id": claim.event_id, "created": claim.created, "lease_owner": claim.lease_owner,
            "attempt": claim.attempt}


def _batch_keys(claims: Sequence[Claim]) -> dict[str, list[Any]]:
    """``_keys`` of each claim of a batch, as the arrays its set-based statements unnest."""
    return {"ids": [claim.event_id for claim in claims], "createds": [claim.created for claim in claims],
            "lease_owners": [claim.lease_owner for claim in claims], "attempts": [claim.attempt for claim in claims]}


def _claim(row: dict[str, Any], lease_owner: str) -> Claim:
    return Claim(event_id=row["id"], type=row["type"], attempt=row["attempts"], lease_owner=lease_owner,
                 payload=row["payload"], created=row["stripe_created"], livemode=row["livemode"],
                 api_version=row["api_version"], account=row["account"], tries=row["tries"],
                 rescued=row["rescued"], liveness_key=row["lease_liveness_key"])


class ApplyTransaction:
    """The open apply transaction (``WorkerLedger.applying``): its object locks, then one member at a time.

    Each member is one claimed event, inside a savepoint: the fence, the caller's
    business writes, the finish. It waits once, at its end, for every
    answer of its statements, so whatever refused or failed is known to be this
    member's before the next one starts, and only its savepoint is rolled back: the
    members before it stay in the batch, the ones after it start from a clean
    transaction. Locks a member took are held to the batch's COMMIT (so no one
    re-claims a finished member before it commits); a member rolled back gives them up.
    The business objects the members write are locked first (``try_lock`` or ``lock``,
    ledger/sql/objects.sql), so that two transactions never take them in opposite
    orders; a handler that writes a row no object key covers is left to Postgres'
    deadlock detection, which fails that member alone (recoverably, db_conflict).
    """

    _SAVEPOINT = "batch_member"

    def __init__(self, conn: psycopg.Connection, pipeline: psycopg.Pipeline):
        self._conn = conn
        self._pipeline = pipeline
        # A member that committed may have left SET LOCAL settings behind; the next starts without them.
        self._settings_changed = False

    @property
    def connection(self) -> psycopg.Connection:
        """The transaction's connection, for what writes in it (a batch's writer)."""
        return self._conn

    def try_lock(self, keys: Iterable[str]) -> set[str]:
        """The object keys this transaction could lock without waiting (object_try_lock)."""
        rows = self._conn.execute(SQL.object_try_lock, {"keys": sorted(set(keys))}).fetchall()
        return {row[0] for row in rows}

    def lock(self, keys: Iterable[str]) -> None:
        """Every object key, in the one global order (object_lock), so no two waiting transactions wait
        for each other and the keys are granted first come, first served. While it waits for one key it
        holds the earlier ones; so each wait is bounded (OBJECT_WAIT_MS): past it, the keys it took are
        let go of (their savepoint rolled back) and it queues for the whole set again. A holder that
        does not let go (a host gone silent inside its transaction, until Postgres ends its session)
        thus holds up nobody else for longer than one wait; the events that need its key itself wait
        up to OBJECT_LOCK_BUDGET_S, then fail recoverably (db_lock_timeout)."""
        wanted = sorted(set(keys))
        conn = self._conn
        deadline = time.monotonic() + OBJECT_LOCK_BUDGET_S
        while True:
            conn.execute("SAVEPOINT object_locks")
            conn.execute(f"SET LOCAL lock_timeout = {OBJECT_WAIT_MS}")
            try:
                conn.execute(SQL.object_lock, {"keys": wanted}).fetchall()
                conn.execute("SET LOCAL lock_timeout TO DEFAULT")
                conn.execute("RELEASE SAVEPOINT object_locks")
                self._pipeline.sync()
                return
            except psycopg.errors.LockNotAvailable:
                self._let_go("object_locks")
                if time.monotonic() > deadline:
                    raise

    def _let_go(self, savepoint: str) -> None:
        """After a failed statement in the pipeline: the answers of what was sent read (an error among them
        is not the one to report: the caller's came first), the savepoint rolled back (what the
        transaction took since is let go of) and released."""
        try:
            self._pipeline.sync()
        except psycopg.Error:
            if self._conn.broken:
                raise
        self._conn.execute(f"ROLLBACK TO SAVEPOINT {savepoint}")
        self._conn.execute(f"RELEASE SAVEPOINT {savepoint}")
        self._pipeline.sync()

    @contextmanager
    def member(self, claim: Claim) -> Iterator[psycopg.Connection]:
        """Apply one claim in its savepoint: LeaseLost when the lease is not ours (the fence or the
        finish refused; none of its writes stays), the body's or a statement's error as raised (its
        savepoint rolled back), BatchLost when the transaction itself is gone."""
        conn = self._conn
        keys = _keys(claim)
        try:
            conn.execute(f"SAVEPOINT {self._SAVEPOINT}")
            if self._settings_changed:
                conn.execute("RESET ALL")
            conn.execute(SQL.event_lock_if_lease_held, keys)
            yield conn
            conn.execute(SQL.event_finish_if_lease_held, keys)
            conn.execute(f"RELEASE SAVEPOINT {self._SAVEPOINT}")
            self._pipeline.sync()  # the member's one wait: every answer, or its first error
        except BaseException as exc:
            self._roll_back_member(exc)
            if isinstance(exc, psycopg.Error) and exc.sqlstate == LEASE_NOT_HELD:
                raise LeaseLost() from None
            raise
        self._settings_changed = True

    def _roll_back_member(self, exc: BaseException) -> None:
        try:
            self._let_go(self._SAVEPOINT)
        except psycopg.Error as lost:
            raise BatchLost(f"the batch's transaction was lost: {type(lost).__name__}") from lost


class SetApplyTransaction(ApplyTransaction):
    """The open set-based apply transaction (``WorkerLedger.applying_together``).

    The fence runs once, for every claim, as it opens: ``held`` are the ids whose lease is
    still the attempt's, their rows locked to COMMIT; a claim not held was taken over and
    must not be applied. Members are then applied one after another on the same connection,
    with no savepoint, each ending with one wait for its statements' answers, so an error is
    known to be the member's it came from; it fails the whole transaction all the same.
    Session settings a member's handler changed with SET LOCAL are reset before the next
    member, as in ``ApplyTransaction.member``. The finish of every member applied is one
    statement, before COMMIT.
    """

    def __init__(self, conn: psycopg.Connection, pipeline: psycopg.Pipeline, claims: Sequence[Claim]):
        super().__init__(conn, pipeline)
        rows = conn.execute(SQL.events_lock_if_leases_held, _batch_keys(claims)).fetchall()
        self.held: frozenset[str] = frozenset(row[0] for row in rows)
        self._applied: list[Claim] = []

    @contextmanager
    def member(self, claim: Claim) -> Iterator[psycopg.Connection]:
        """Apply one held claim: its writes join the transaction, its finish is the batch's."""
        if claim.event_id not in self.held:
            raise LeaseLost()
        if self._settings_changed:
            self._conn.execute("RESET ALL")
        yield self._conn
        self._pipeline.sync()  # the member's one wait: an error now is this member's, not the next one's
        self._settings_changed = True
        self._applied.append(claim)

    def withdraw(self, claim: Claim) -> None:
        """A member applied whose rows will not be written in this transaction after all (its objects are
        another's now): it is not finished by it, and goes in a later one."""
        self._applied.remove(claim)

    @property
    def broken(self) -> bool:
        """The connection is gone: whatever failed is the transaction's, no one member's."""
        return self._conn.broken

    def finish(self) -> None:
        """processing -> processed for every member applied (events_finish_if_leases_held); LL001 aborts
        the transaction if any of them no longer holds its lease."""
        if self._applied:
            self._conn.execute(SQL.events_finish_if_leases_held, _batch_keys(self._applied))
