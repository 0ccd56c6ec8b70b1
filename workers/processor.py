"""Attempts at events: claim, apply through the handlers, finish or fail; one event or a batch, one path.

The path of an attempt (retries exhausted, fail, lease lost) is workers.attempt's,
shared with effect delivery; what is the event's own is here. Every wake-up takes
the same path, whether it arrives alone (a countdown's, ``process``) or among the
wake-ups a worker held together (``process_batch``): one compare-and-set claims
every id it can; one set-based transaction (``WorkerLedger.applying_together``, no
savepoint per event) fences them all in one statement, runs each event's handlers in
Stripe's order (they record rows, workers/rows.py), locks the objects those rows
belong to, writes the batch's rows in one go (workers/writers.py), finishes every
event applied in one statement, and one COMMIT ends it (or a few: an event whose
objects another transaction holds goes in a later one that waits for them, and a
handler that runs long ends its transaction early; see ``_apply_all``). An event
whose own handlers fail takes that transaction with it: its failure is recorded and
the others are applied again, together. Only when the transaction fails for a reason
no event owns are the events applied again each in a savepoint of its own
(``WorkerLedger.applying``: fenced, written and finished per event, a failing one
rolled back alone). After the COMMIT each attempt is concluded on its own by
workers.attempt's rules, its failure recorded and its wake-ups sent.

A thin event notification is fetched first (workers/thin.py: the object or the v2 event
it points at), after the claim and before the apply transaction opens, so no transaction
or pooled connection waits on Stripe; a failed fetch is the attempt's failure, classified
like any other. Thin members are fetched up to ``fetch_concurrency`` at once (threads
that only wait on Stripe).

The Celery task is a thin shell around ``process`` and ``process_batch``
(workers/tasks.py, workers/batching.py); this module knows nothing about Celery,
so tests and ``ledgerctl`` can drive it directly.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable, Sequence

import psycopg

from ledger.config import Settings
from ledger.errors import LeaseLost
from ledger.states import EventStatus
from ledger import stripe_events
from ledger.attempts import ApplyTransaction, BatchLost, Claim, FailureRecord, WorkerLedger
from workers import metrics, thin
from workers.attempt import LeasedWork, outcomes
from workers.failures import SESSION_LOST, Failure, Kind, classify
from workers.handlers import ApplyContext, HandlerRegistry, object_keys
from workers.retry import RetryPolicy
from workers.thin import Applied, ThinFetcher
from workers.wakeup import Waker
from workers.writers import LiveWriter

log = logging.getLogger(__name__)

# How long an apply transaction may hold what it has applied before it commits and goes on in the next
# (see _apply_all): far above a batch's usual few to a hundred milliseconds.
BATCH_HOLD_S = 1.0

Outcome = outcomes("Outcome", __name__, EventStatus.PROCESSED, EventStatus.FAILED_RECOVERABLE,
                   EventStatus.FAILED_PERMANENT)


@dataclass
class EventProcessor(LeasedWork):
    ledger: WorkerLedger
    registry: HandlerRegistry
    policy: RetryPolicy
    waker: Waker | None
    lease_s: int
    # Effects some sender can deliver (built-in handlers skip the others).
    enabled_effects: frozenset[str] = frozenset()
    # host:pid of the process that runs the attempt (read when built, i.e. after fork).
    worker_name: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # What thin notifications point at, fetched from Stripe's API (None: a thin notification fails
    # permanently, stripe_api_key_missing); a batch fetches up to fetch_concurrency at once.
    fetcher: ThinFetcher | None = None
    fetch_concurrency: int = 1
    _fetch_threads: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    status = EventStatus
    finished = EventStatus.PROCESSED
    outcome = Outcome
    abandoned = "every attempt ended with its worker gone"

    @classmethod
    def from_settings(cls, settings: Settings, ledger: WorkerLedger, registry: HandlerRegistry,
                      waker: Waker | None, enabled_effects: frozenset[str] = frozenset()) -> "EventProcessor":
        return cls(ledger=ledger, registry=registry, policy=RetryPolicy.from_settings(settings), waker=waker,
                   lease_s=settings.lease_s, enabled_effects=enabled_effects, fetcher=ThinFetcher(settings),
                   fetch_concurrency=settings.stripe_fetch_concurrency)

    def process(self, event_id: str) -> Outcome:
        """One attempt at one event: ``process_batch`` of one."""
        return self.process_batch([event_id])[0]

    def process_batch(self, event_ids: Sequence[str]) -> list[Outcome]:
        """One attempt per event id, made together (see the module's docstring); their outcomes in
        the order of ``event_ids``. A repeated id is NOT_CLAIMED: its first copy is the attempt."""
        unique = list(dict.fromkeys(event_ids))
        claims = self.ledger.claim(unique, worker=self.worker_name, lease_s=self.lease_s) if unique else []
        outcomes = dict(zip((claim.event_id for claim in claims), self.attempt(claims)))
        seen: set[str] = set()
        answers = []
        for event_id in event_ids:
            first = event_id not in seen
            seen.add(event_id)
            answers.append(outcomes[event_id] if first and event_id in outcomes else self._not_claimed(event_id))
        return answers

    def attempt(self, claims: Sequence[Claim]) -> list[Outcome]:
        """The attempts of claims already made (by ``process_batch``, or held by a stalled worker that
        carries on): applied, then each concluded on its own; their outcomes, in order."""
        started = time.perf_counter()
        results = self._apply_all(list(claims))
        outcomes = []
        for claim in claims:
            try:
                outcomes.append(self._conclude(claim, results[claim.event_id], _fields(claim)))
            finally:
                metrics.ATTEMPT_SECONDS.labels(claim.type).observe(time.perf_counter() - started)
        return outcomes

    def _apply_all(self, claims: list[Claim]) -> dict[str, Failure | LeaseLost | None]:
        """The work of the claims: every claim's result (as ``_conclude`` takes it) once its
        transaction has ended; the wake-ups of the effects committed are sent.

        Object locks (ledger/sql/objects.sql): a first transaction takes, without waiting, each
        member's keys just before it applies that member, and applies it when they are all its own;
        the others go in a later transaction that waits for their keys, all of them at once in the
        one global order. So no two transactions ever wait for each other in a cycle (no deadlock,
        whatever order the wake-ups arrive in), and a transaction holding a batch's locks never
        waits for one.

        A transaction holds what it has applied until its COMMIT. So once it has been open for
        BATCH_HOLD_S, it commits before the next member, and the rest go in the next transaction:
        a member whose handler runs long (legitimately: it is never taken over) holds up the
        members applied before it in its transaction, never the ones after it, nor their objects."""
        results: dict[str, Failure | LeaseLost | None] = {}
        to_fetch: list[Claim] = []
        for claim in claims:
            if claim.rescued:
                metrics.WORKER_RESCUES.labels("lease_expired", "event").inc()
            refused = self._refused(claim)
            if refused is not None:
                results[claim.event_id] = refused
            else:
                to_fetch.append(claim)
        fetched = self._fetch_all(to_fetch)  # before any transaction opens
        members: list[_Member] = []
        for claim in to_fetch:
            event = fetched[claim.event_id]
            if isinstance(event, Failure):
                results[claim.event_id] = event
            else:
                members.append(_Member(claim, event, frozenset(object_keys(event.event))))
        # In Stripe's order, as the writer plans a batch's rows: a subscription's transitions chain in it,
        # and its effects are recorded in it.
        members.sort(key=lambda member: (member.claim.created, member.claim.event_id))
        deferred: list[_Member] = []
        while members:
            round_deferred, members = self._apply_round(members, results, wait=False)
            deferred.extend(round_deferred)
        if deferred:
            metrics.LOCK_DEFERRALS.inc(len(deferred))
        out_of_time = next((result for result in results.values()
                            if isinstance(result, Failure) and result.reason == "time_limit"), None)
        if out_of_time is not None:
            for member in deferred:
                results[member.claim.event_id] = _not_applied_in_time(out_of_time)
            deferred = []
        while deferred:
            _, deferred = self._apply_round(deferred, results, wait=True)
        return results

    def _apply_round(self, members: list["_Member"], results: dict, *,
                     wait: bool) -> tuple[list["_Member"], list["_Member"]]:
        """One transaction: lock the members' objects (``wait``: all of the round's at once, in order;
        else each member's just before it, what is free), apply each member that holds its keys, COMMIT.
        Records each applied member's result in ``results``; returns the members left for a
        transaction that waits, and those not reached before BATCH_HOLD_S ran out (for the next).

        A round is first tried set-based (``_apply_together``); only when that fails is it applied again
        one savepoint per member, where a member at fault fails alone."""
        together = self._apply_together(members, results, wait=wait)
        if together is not None:
            return together
        return self._apply_one_by_one(members, results, wait=wait)

    def _apply_together(self, members: list["_Member"], results: dict, *,
                        wait: bool = False) -> tuple[list["_Member"], list["_Member"]] | None:
        """The round as one set-based transaction (WorkerLedger.applying_together): one fence and one
        finish for the batch, no savepoint per member, BATCH_HOLD_S as in ``_apply_one_by_one``.

        Object keys (``wait``: all of the round's at once, in order, first). Otherwise every member's
        handlers run first, recording rows and touching no object; then, just before anything is written
        (the batch's rows, a handler's own SQL, an effect), one statement takes the keys of every member
        run since the last write, without waiting (``_KeysBeforeWrites``). A member whose keys another
        transaction holds is not written: its rows are forgotten and it goes in a later transaction that
        waits. So a handler never runs holding a key, and a batch pays one statement for its keys.

        A member that fails takes the transaction with it, but the failure is known to be its own: it is
        recorded as that member's (its handlers ran once, as in a savepoint of its own) and the others are
        applied again, together. Past the task's soft time limit nothing is applied again: every member
        gets the time limit's failure. A failure that is no member's (the finish, the COMMIT, a broken
        connection) returns None: nothing of it committed, and the caller applies the members one by one."""
        applied: dict[str, tuple[Claim, ApplyContext]] = {}
        deferred: list[_Member] = []
        not_reached: list[_Member] = []
        lost: dict[str, LeaseLost] = {}
        try:
            with self.ledger.applying_together([member.claim for member in members]) as tx:
                writer = LiveWriter(tx.connection)
                opened = time.monotonic()
                if wait:
                    tx.lock(set().union(*(member.keys for member in members)))
                else:
                    gate = _KeysBeforeWrites(tx, writer, on_deferred=lambda m: (
                        deferred.append(m), applied.pop(m.claim.event_id, None)))
                for n, member in enumerate(members):
                    claim = member.claim
                    if claim.event_id not in tx.held:
                        lost[claim.event_id] = LeaseLost()
                        continue
                    if applied and time.monotonic() - opened > BATCH_HOLD_S:
                        not_reached = members[n:]
                        break
                    if not wait:
                        gate.running(member)
                    try:
                        with tx.member(claim) as conn:
                            # By the claim: a thin one's context has its twin's id.
                            applied[claim.event_id] = (claim, self._run_handlers(conn, claim, member.event, writer))
                    except _NotNow:
                        continue  # its keys are another transaction's: it waits for them in a later one
                    except Exception as exc:
                        failure = classify(exc)  # classified where caught
                        # A terminated backend's FATAL can arrive before psycopg has seen the connection close.
                        if tx.broken or failure.reason in SESSION_LOST:
                            raise
                        raise _MemberFailed(member, failure) from exc
                    if not wait:
                        gate.ran(member)
                # Every member's rows in one go; a failure here is no one member's (the caller applies
                # them again, each in a savepoint of its own, where one at fault fails alone).
                writer.flush()
        except _MemberFailed as failed:
            metrics.APPLY_FALLBACKS.labels(failed.failure.reason).inc()
            results[failed.member.claim.event_id] = failed.failure
            if failed.failure.reason == "time_limit":
                results.update(lost)
                for member in members:
                    results.setdefault(member.claim.event_id, _not_applied_in_time(failed.failure))
                return [], []
            return self._apply_round([member for member in members if member is not failed.member], results,
                                     wait=wait)
        except Exception as exc:  # the transaction's own: the members go again, one savepoint each
            metrics.APPLY_FALLBACKS.labels(classify(exc).reason).inc()
            return None
        results.update(lost)
        self._committed(list(applied.values()), results)
        return deferred, not_reached

    def _apply_one_by_one(self, members: list["_Member"], results: dict, *,
                          wait: bool) -> tuple[list["_Member"], list["_Member"]]:
        """The round with each member in a savepoint of its own (WorkerLedger.applying): a member that
        fails or lost its lease is rolled back alone."""
        applied: list[tuple[Claim, ApplyContext]] = []
        deferred: list[_Member] = []
        attempted: list[_Member] = []
        not_reached: list[_Member] = []
        try:
            with self.ledger.applying([member.claim for member in members]) as tx:
                opened = time.monotonic()
                if wait:
                    tx.lock(set().union(*(member.keys for member in members)))
                out_of_time: Failure | None = None
                for n, member in enumerate(members):
                    claim = member.claim
                    if out_of_time is not None:
                        results[claim.event_id] = out_of_time
                        continue
                    if attempted and time.monotonic() - opened > BATCH_HOLD_S:
                        not_reached = members[n:]
                        break
                    if not wait and member.keys and not member.keys <= tx.try_lock(member.keys):
                        deferred.append(member)
                        continue
                    attempted.append(member)
                    result = self._apply_member(tx, claim, member.event)
                    if isinstance(result, ApplyContext):
                        applied.append((claim, result))  # by the claim: a thin one's context has its twin's id
                        continue
                    results[claim.event_id] = result
                    if isinstance(result, Failure) and result.reason == "time_limit":
                        # The task's soft time limit: the members not reached yet are not attempted.
                        out_of_time = _not_applied_in_time(result)
        except Exception as exc:  # the transaction as a whole (locks, COMMIT, the connection): nothing committed
            failure = _transaction_failure(exc, lone=len(attempted) == 1)
            for member in members:
                results.setdefault(member.claim.event_id, failure)
            return [], []
        self._committed(applied, results)
        # Past the time limit every member was given a result but the deferred ones: _apply_all gives them theirs.
        return deferred, not_reached

    def _committed(self, applied: list[tuple[Claim, ApplyContext]], results: dict) -> None:
        """After a round's COMMIT: each applied member succeeded, and what its transaction committed is announced."""
        for claim, context in applied:
            results[claim.event_id] = None
            self._after_commit(context)

    def _apply_member(self, tx: ApplyTransaction, claim: Claim, event: Applied) -> ApplyContext | Failure | LeaseLost:
        try:
            with tx.member(claim) as conn:
                writer = LiveWriter(conn)
                context = self._run_handlers(conn, claim, event, writer)
                writer.flush()  # in the member's savepoint: its rows, or its failure alone
                return context
        except BatchLost:
            raise  # the transaction's, not this member's: _apply_round fails every member with it
        except LeaseLost as lost:
            return lost
        except Exception as exc:  # classified right here, where it is caught
            return classify(exc)

    def _not_claimed(self, event_id: str) -> Outcome:
        log.info("not claimed", extra={"event_id": event_id, "outcome": Outcome.NOT_CLAIMED.value})
        return Outcome.NOT_CLAIMED

    def _refusal(self, claim: Claim) -> Failure | None:
        if not self.registry.resolve(stripe_events.handler_type(claim.type)):
            # Decided before any business write or API call: no handler, nothing to retry.
            return Failure(Kind.PERMANENT, "unsupported_type", "UnsupportedType",
                           f"no handler for event type {claim.type}")
        return None

    def _fetch(self, claim: Claim) -> Applied | Failure:
        """The event the claim's handlers take: a snapshot event as delivered, a thin notification's
        object or v2 event fetched now (no transaction is open); a failed fetch, classified."""
        if not stripe_events.is_thin(claim.payload):
            return thin.applied(claim)
        try:
            if self.fetcher is None:
                raise thin.MissingStripeKey()
            return self.fetcher.fetch(claim)
        except Exception as exc:  # classified right here, where it is caught
            return classify(exc)

    def _fetch_all(self, claims: list[Claim]) -> dict[str, Applied | Failure]:
        """``_fetch`` of every claim, by event id; a batch's thin notifications up to fetch_concurrency at
        once, in threads of this process (each fetch only waits on Stripe)."""
        thin_claims = [claim for claim in claims if stripe_events.is_thin(claim.payload)]
        if len(thin_claims) < 2 or self.fetch_concurrency < 2:
            return {claim.event_id: self._fetch(claim) for claim in claims}
        if self._fetch_threads is None:
            self._fetch_threads = ThreadPoolExecutor(self.fetch_concurrency, thread_name_prefix="thin-fetch")
        futures = {claim.event_id: self._fetch_threads.submit(self._fetch, claim) for claim in thin_claims}
        results = {claim.event_id: self._fetch(claim) for claim in claims if claim.event_id not in futures}
        for event_id, future in futures.items():
            try:
                results[event_id] = future.result()
            except Exception as exc:  # raised in this thread while it waits: the task's soft time limit
                failure = classify(exc)
                for pending_id, pending in futures.items():
                    pending.cancel()
                    results.setdefault(pending_id, failure)
                break
        return results

    def _run_handlers(self, conn: psycopg.Connection, claim: Claim, event: Applied, writer: LiveWriter) -> ApplyContext:
        """Every handler of the event's type, in order, on the apply transaction's connection, once the
        fields they require are known to be there (an event missing one writes nothing). Their rows go to
        ``writer``, which the caller flushes (a raw-SQL handler's first statement flushes it too)."""
        self.registry.check_required(event.type, event.event, event.event.get("api_version") or claim.api_version)
        if event.snapshot_twin is not None:
            self.ledger.record_snapshot_twin(conn, claim.event_id, event.snapshot_twin)
        if event.fetched is not None:  # kept with the event: a rebuild applies the same object
            self.ledger.record_applied_object(conn, claim, event.fetched.object, fetched_at=event.fetched.at,
                                              api_version=event.fetched.api_version, applied_as=event.snapshot_twin)
        context = ApplyContext(conn=conn, event_id=event.snapshot_twin or claim.event_id, event_type=event.type,
                               created=claim.created, livemode=claim.livemode, account=claim.account,
                               event=event.event, attempt=claim.attempt, enabled_effects=self.enabled_effects,
                               ledger_event_id=claim.event_id,
                               rows=writer.rows_for(event_id=event.snapshot_twin or claim.event_id, created=claim.created,
                                                    account=claim.account, livemode=claim.livemode))
        self.registry.apply(context)
        return context

    def _after_commit(self, context: ApplyContext) -> None:
        """What the committed attempt announces: its effects' wake-ups (a lost one is re-driven by the
        sweep), then what its handlers asked to run once their writes are visible."""
        if self.waker is not None:
            for outbox_id in context.emitted:
                self.waker.wake_effect(outbox_id)
        context.run_after_commit()

    def _record_failure(self, claim: Claim, record: FailureRecord) -> None:
        self.ledger.fail(claim, record)

    def _wake(self, claim: Claim, countdown_s: float) -> None:
        self.waker.wake(claim.event_id, countdown_s=countdown_s)

    def _on_done(self, claim: Claim, fields: dict) -> None:
        metrics.ATTEMPTS.labels(claim.type, Outcome.PROCESSED.value, "").inc()
        log.info("event processed", extra={**fields, "outcome": Outcome.PROCESSED.value})

    def _on_failure(self, claim: Claim, outcome: StrEnum, record: FailureRecord, fields: dict) -> None:
        metrics.ATTEMPTS.labels(claim.type, outcome.value, record.reason).inc()
        if outcome is Outcome.FAILED_RECOVERABLE:
            metrics.RETRIES_SCHEDULED.labels(claim.type, record.reason).inc()
        log.warning("attempt failed", extra={**fields, "outcome": outcome.value, "reason": record.reason,
                                             "error_class": record.error_class, "retry_in_s": record.delay_s})

    def _on_lease_lost(self, claim: Claim, fields: dict) -> None:
        self.ledger.mark_lease_lost(claim, "lease expired and was taken over; this attempt rolled back")
        metrics.ATTEMPTS.labels(claim.type, Outcome.LEASE_LOST.value, "lease_lost").inc()
        log.warning("lease lost; attempt rolled back", extra={**fields, "outcome": Outcome.LEASE_LOST.value})


def _fields(claim: Claim) -> dict:
    """What every log line of an attempt carries."""
    return {"event_id": claim.event_id, "type": claim.type, "attempt": claim.attempt}


def _transaction_failure(exc: Exception, *, lone: bool) -> Failure:
    """How the apply transaction failed, as the failure of every member it took with it. A lone
    member's it is, classified as any failure of its own. Of several, recoverable whatever its class,
    because it is no one member's (a lost connection, a deferred constraint checked at COMMIT): the
    retry's wake-up carries a countdown and runs alone, where a member at fault fails on its own."""
    cause = exc.__cause__ if isinstance(exc, BatchLost) and exc.__cause__ is not None else exc
    failure = classify(cause)
    return failure if lone else dataclasses.replace(failure, kind=Kind.RECOVERABLE)


def _not_applied_in_time(out_of_time: Failure) -> Failure:
    """The failure of a member the batch did not apply before the task's soft time limit (recoverable)."""
    return dataclasses.replace(out_of_time, message="the batch reached its time limit before this event was applied")


class _NotNow(BaseException):
    """The member whose handler is running cannot be written in this transaction (its keys are another's):
    raised out of its handler's first SQL or effect, before either runs. A BaseException, so that a
    handler's ``except Exception`` does not keep it from going to a later transaction."""


class _KeysBeforeWrites:
    """The object keys of a set-based round's members, taken just before anything of theirs is written
    (the writer's ``before_write``): every member run since the last write, in one try-lock statement.
    A member that did not get all its keys is deferred: its rows forgotten, its finish withdrawn; the
    member whose handler is running (one that reached for ``ctx.conn`` or ``emit``) gets _NotNow once
    the others' rows are written."""

    def __init__(self, tx: ApplyTransaction, writer: LiveWriter, *, on_deferred: Callable[["_Member"], Any]):
        self._tx = tx
        self._writer = writer
        self._on_deferred = on_deferred
        self._pending: list[tuple[_Member, int]] = []  # run since the last write, where their changes start
        self._current: tuple[_Member, int] | None = None
        self._stopped: _Member | None = None
        writer.before_write = self._take_keys
        writer.after_write = self._stop_current

    def running(self, member: "_Member") -> None:
        self._current = (member, self._writer.changes.mark()[0])

    def ran(self, member: "_Member") -> None:
        self._pending.append(self._current)
        self._current = None

    def _take_keys(self) -> None:
        members = self._pending + ([self._current] if self._current else [])
        wanted = set().union(*(member.keys for member, _ in members))
        held = self._tx.try_lock(wanted) if wanted else set()
        spans, ends = [], [start for _, start in members[1:]] + [len(self._writer.changes.items)]
        for (member, start), end in zip(members, ends):
            if not member.keys <= held:
                spans.append((start, end))
                if self._current is not None and member is self._current[0]:
                    self._stopped = member
                else:
                    self._tx.withdraw(member.claim)
                    self._on_deferred(member)
        if spans:
            self._writer.changes.drop(spans)
        self._pending = []
        if self._current is not None:  # this flush writes what it recorded so far: the rest starts anew
            self._current = (self._current[0], 0)

    def _stop_current(self) -> None:
        if self._stopped is not None:
            member, self._stopped, self._current = self._stopped, None, None
            self._on_deferred(member)
            raise _NotNow()


class _MemberFailed(Exception):
    """A member of a set-based apply failed (its own handlers or statements): the failure recorded as its."""

    def __init__(self, member: "_Member", failure: Failure):
        super().__init__(failure.reason)
        self.member = member
        self.failure = failure


@dataclass(frozen=True)
class _Member:
    """A claimed event ready to apply: what its handlers take, and the object keys it locks."""
    claim: Claim
    event: Applied
    keys: frozenset[str]
