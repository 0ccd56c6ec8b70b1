"""Attempts at events: claim, apply through the handlers, finish or fail; one event, or a batch.

The path of an attempt (retries exhausted, fail, lease lost) is workers.attempt's,
shared with effect delivery; what is the event's own is here: its handlers run
inside ``WorkerLedger.applying`` (the fence, their writes and the finish commit
together), effects they recorded are woken after COMMIT, and its metrics.

``process_batch`` makes the same attempts at several events for the price of one
claim and one COMMIT: one compare-and-set claims every id it can, one transaction
applies each claimed event in a savepoint of its own (``WorkerLedger.applying_batch``:
fenced and finished per event, a failing one rolled back alone), and after the
COMMIT each attempt is concluded on its own by workers.attempt's rules, its failure
recorded and its wake-ups sent.

A thin event notification is fetched first (workers/thin.py: the object or the v2 event
it points at), after the claim and before the apply transaction opens, so no transaction
or pooled connection waits on Stripe; a failed fetch is the attempt's failure, classified
like any other. A batch fetches its thin members before its one transaction, up to
``fetch_concurrency`` at once (threads that only wait on Stripe).

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
from typing import Sequence

import psycopg

from ledger.config import Settings
from ledger.errors import LeaseLost
from ledger.states import EventStatus
from ledger.store import BatchApply, BatchLost, Claim, FailureRecord, WorkerLedger
from workers import metrics, thin
from workers.attempt import LeasedWork, outcomes
from workers.failures import Failure, Kind, classify
from workers.handlers import ApplyContext, HandlerRegistry
from workers.retry import RetryPolicy
from workers.thin import Applied, ThinFetcher
from workers.wakeup import Waker

log = logging.getLogger(__name__)

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
        claim = self.ledger.claim(event_id, worker=self.worker_name, lease_s=self.lease_s)
        if claim is None:
            return self._not_claimed(event_id)
        if claim.rescued:
            metrics.LEASE_RESCUES.inc()
        started = time.perf_counter()
        try:
            return self._attempt(claim, _fields(claim))
        finally:
            metrics.ATTEMPT_SECONDS.labels(claim.type).observe(time.perf_counter() - started)

    def process_batch(self, event_ids: Sequence[str]) -> list[Outcome]:
        """One attempt per event id, made together (see the module's docstring); their outcomes in
        the order of ``event_ids``. A repeated id is NOT_CLAIMED: its first copy is the attempt."""
        unique = list(dict.fromkeys(event_ids))
        claims = self.ledger.claim_batch(unique, worker=self.worker_name, lease_s=self.lease_s) if unique else []
        started = time.perf_counter()
        results = self._apply_batch(claims)
        outcomes = {}
        for claim in claims:
            try:
                outcomes[claim.event_id] = self._conclude(claim, results[claim.event_id], _fields(claim))
            finally:
                metrics.ATTEMPT_SECONDS.labels(claim.type).observe(time.perf_counter() - started)
        seen: set[str] = set()
        answers = []
        for event_id in event_ids:
            first = event_id not in seen
            seen.add(event_id)
            answers.append(outcomes[event_id] if first and event_id in outcomes else self._not_claimed(event_id))
        return answers

    def _apply_batch(self, claims: list[Claim]) -> dict[str, Failure | LeaseLost | None]:
        """The work of a batch: every claim's result (as ``_conclude`` takes it) once the batch's
        transaction has ended; the wake-ups of the effects it committed are sent."""
        results: dict[str, Failure | LeaseLost | None] = {}
        to_fetch: list[Claim] = []
        for claim in claims:
            if claim.rescued:
                metrics.LEASE_RESCUES.inc()
            refused = self._refused(claim)
            if refused is not None:
                results[claim.event_id] = refused
            else:
                to_fetch.append(claim)
        fetched = self._fetch_all(to_fetch)  # before the batch's transaction opens
        to_apply: list[tuple[Claim, Applied]] = []
        for claim in to_fetch:
            if isinstance(fetched[claim.event_id], Failure):
                results[claim.event_id] = fetched[claim.event_id]
            else:
                to_apply.append((claim, fetched[claim.event_id]))
        if not to_apply:
            return results
        applied: list[tuple[Claim, ApplyContext]] = []
        try:
            with self.ledger.applying_batch() as batch:
                out_of_time: Failure | None = None
                for claim, event in to_apply:
                    if out_of_time is not None:
                        results[claim.event_id] = out_of_time
                        continue
                    result = self._apply_member(batch, claim, event)
                    if isinstance(result, ApplyContext):
                        applied.append((claim, result))  # by the claim: a thin one's context has its twin's id
                        continue
                    results[claim.event_id] = result
                    if isinstance(result, Failure) and result.reason == "time_limit":
                        # The task's soft time limit: the members not reached yet are not attempted.
                        out_of_time = dataclasses.replace(
                            result, message="the batch reached its time limit before this event was applied")
        except Exception as exc:  # the transaction as a whole (COMMIT, the connection): nothing of it committed
            failure = _batch_failure(exc)
            for claim, _ in to_apply:
                results.setdefault(claim.event_id, failure)
            return results
        for claim, context in applied:
            results[claim.event_id] = None
            self._after_commit(context)
        return results

    def _apply_member(self, batch: BatchApply, claim: Claim, event: Applied) -> ApplyContext | Failure | LeaseLost:
        try:
            with batch.member(claim) as conn:
                return self._run_handlers(conn, claim, event)
        except BatchLost:
            raise  # the batch's, not this member's: _apply_batch fails every member with it
        except LeaseLost as lost:
            return lost
        except Exception as exc:  # classified right here, where it is caught
            return classify(exc)

    def _not_claimed(self, event_id: str) -> Outcome:
        log.info("not claimed", extra={"event_id": event_id, "outcome": Outcome.NOT_CLAIMED.value})
        return Outcome.NOT_CLAIMED

    def _refusal(self, claim: Claim) -> Failure | None:
        if not self.registry.resolve(thin.handler_type(claim.type)):
            # Decided before any business write or API call: no handler, nothing to retry.
            return Failure(Kind.PERMANENT, "unsupported_type", "UnsupportedType",
                           f"no handler for event type {claim.type}")
        return None

    def _work(self, claim: Claim) -> Failure | None:
        event = self._fetch(claim)
        if isinstance(event, Failure):
            return event
        try:
            with self.ledger.applying(claim) as conn:
                context = self._run_handlers(conn, claim, event)
        except LeaseLost:
            raise
        except Exception as exc:  # classified right here, where it is caught
            return classify(exc)
        self._after_commit(context)
        return None

    def _fetch(self, claim: Claim) -> Applied | Failure:
        """The event the claim's handlers take: a snapshot event as delivered, a thin notification's
        object or v2 event fetched now (no transaction is open); a failed fetch, classified."""
        if not thin.is_thin(claim.payload):
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
        thin_claims = [claim for claim in claims if thin.is_thin(claim.payload)]
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

    def _run_handlers(self, conn: psycopg.Connection, claim: Claim, event: Applied) -> ApplyContext:
        """Every handler of the event's type, in order, on the apply transaction's connection, once the
        fields they require are known to be there (an event missing one writes nothing)."""
        self.registry.check_required(event.type, event.event, event.event.get("api_version") or claim.api_version)
        if event.snapshot_twin is not None:
            self.ledger.record_snapshot_twin(conn, claim.event_id, event.snapshot_twin)
        context = ApplyContext(conn=conn, event_id=event.snapshot_twin or claim.event_id, event_type=event.type,
                               created=claim.created, livemode=claim.livemode, account=claim.account,
                               event=event.event, attempt=claim.attempt, enabled_effects=self.enabled_effects,
                               ledger_event_id=claim.event_id)
        for handle in self.registry.resolve(event.type):
            handle(context)
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


def _batch_failure(exc: Exception) -> Failure:
    """How the batch's transaction failed, as the failure of every member it took with it:
    recoverable whatever its class, because it is no member's own (a lost connection, a
    deferred constraint checked at COMMIT). The retry's wake-up carries a countdown, which
    runs alone (workers/batching.py): there a member that is at fault fails on its own."""
    cause = exc.__cause__ if isinstance(exc, BatchLost) and exc.__cause__ is not None else exc
    return dataclasses.replace(classify(cause), kind=Kind.RECOVERABLE)
