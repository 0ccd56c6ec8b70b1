"""One attempt at one event: claim, apply through the handlers, finish or fail.

The path of an attempt (retries exhausted, fail, lease lost) is workers.attempt's,
shared with effect delivery; what is the event's own is here: its handlers run
inside ``WorkerLedger.applying`` (the fence, their writes and the finish commit
together), effects they recorded are woken after COMMIT, and its metrics.

The Celery task is a thin shell around ``EventProcessor.process``; this module
knows nothing about Celery, so tests and ``ledgerctl`` can drive it directly.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from enum import StrEnum

from ledger.config import Settings
from ledger.errors import LeaseLost
from ledger.states import EventStatus
from ledger.store import Claim, FailureRecord, WorkerLedger
from workers import metrics
from workers.attempt import LeasedWork, outcomes
from workers.failures import Failure, Kind, classify
from workers.handlers import ApplyContext, HandlerRegistry
from workers.retry import RetryPolicy
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

    status = EventStatus
    finished = EventStatus.PROCESSED
    outcome = Outcome
    abandoned = "every attempt ended with its worker gone"

    @classmethod
    def from_settings(cls, settings: Settings, ledger: WorkerLedger, registry: HandlerRegistry,
                      waker: Waker | None, enabled_effects: frozenset[str] = frozenset()) -> "EventProcessor":
        return cls(ledger=ledger, registry=registry, policy=RetryPolicy.from_settings(settings), waker=waker,
                   lease_s=settings.lease_s, enabled_effects=enabled_effects)

    def process(self, event_id: str) -> Outcome:
        claim = self.ledger.claim(event_id, worker=self.worker_name, lease_s=self.lease_s)
        if claim is None:
            log.info("not claimed", extra={"event_id": event_id, "outcome": Outcome.NOT_CLAIMED.value})
            return Outcome.NOT_CLAIMED
        fields = {"event_id": claim.event_id, "type": claim.type, "attempt": claim.attempt}
        if claim.rescued:
            metrics.LEASE_RESCUES.inc()
        started = time.perf_counter()
        try:
            return self._attempt(claim, fields)
        finally:
            metrics.ATTEMPT_SECONDS.labels(claim.type).observe(time.perf_counter() - started)

    def _refusal(self, claim: Claim) -> Failure | None:
        if not self.registry.resolve(claim.type):
            # Decided before any business write: no handler, nothing to retry.
            return Failure(Kind.PERMANENT, "unsupported_type", "UnsupportedType",
                           f"no handler for event type {claim.type}")
        return None

    def _work(self, claim: Claim) -> Failure | None:
        handlers = self.registry.resolve(claim.type)
        try:
            with self.ledger.applying(claim) as conn:
                context = ApplyContext(conn=conn, event_id=claim.event_id, event_type=claim.type,
                                       created=claim.created, livemode=claim.livemode, account=claim.account,
                                       event=claim.payload, attempt=claim.attempt,
                                       enabled_effects=self.enabled_effects)
                for handle in handlers:
                    handle(context)
        except LeaseLost:
            raise
        except Exception as exc:  # classified right here, where it is caught
            return classify(exc)
        if self.waker is not None:
            # After COMMIT: the effects exist; a lost wake-up is re-driven by the sweep.
            for outbox_id in context.emitted:
                self.waker.wake_effect(outbox_id)
        return None

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
