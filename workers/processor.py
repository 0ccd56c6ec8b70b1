"""One attempt at one event: claim, apply through the handlers, finish or fail.

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
from ledger.states import EventStatus
from ledger.store import Claim, FailureRecord, LeaseLost, WorkerLedger
from workers import metrics
from workers.app import MAX_COUNTDOWN_S
from workers.failures import Failure, Kind, classify
from workers.registry import ApplyContext, HandlerRegistry
from workers.retry import GiveUp, RetryPolicy
from workers.wakeup import Waker

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    PROCESSED = "processed"
    FAILED_RECOVERABLE = "failed_recoverable"
    FAILED_PERMANENT = "failed_permanent"
    NOT_CLAIMED = "not_claimed"   # another worker has it, it is done, or it is not due
    LEASE_LOST = "lease_lost"     # our lease was taken over; nothing of ours committed


@dataclass
class EventProcessor:
    ledger: WorkerLedger
    registry: HandlerRegistry
    policy: RetryPolicy
    waker: Waker | None
    lease_s: int
    # Effects some sender can deliver (built-in handlers skip the others).
    enabled_effects: frozenset[str] = frozenset()
    # host:pid of the process that runs the attempt (read when built, i.e. after fork).
    worker_name: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")

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

    def _attempt(self, claim: Claim, fields: dict) -> Outcome:
        handlers = self.registry.resolve(claim.type)
        if not handlers:
            # Decided before any business write: no handler, nothing to retry.
            return self._fail(claim, Failure(Kind.PERMANENT, "unsupported_type", "UnsupportedType",
                                             f"no handler for event type {claim.type}"), fields)
        if claim.tries > self.policy.max_attempts:
            # Only reachable through lease rescues: a worker keeps dying on this event.
            return self._fail(claim, Failure(Kind.PERMANENT, "retries_exhausted", "LeaseExpired",
                                             "every attempt ended with its worker gone"), fields)

        try:
            with self.ledger.applying(claim) as conn:
                context = ApplyContext(conn=conn, event_id=claim.event_id, event_type=claim.type,
                                       created=claim.created, livemode=claim.livemode, account=claim.account,
                                       event=claim.payload, attempt=claim.attempt,
                                       enabled_effects=self.enabled_effects)
                for handle in handlers:
                    handle(context)
        except LeaseLost:
            return self._lease_lost(claim, fields)
        except Exception as exc:  # classified right here, where it is caught
            return self._fail(claim, classify(exc), fields)

        if self.waker is not None:
            # After COMMIT: the effects exist; a lost wake-up is re-driven by the sweep.
            for outbox_id in context.emitted:
                self.waker.wake_effect(outbox_id)

        metrics.ATTEMPTS.labels(claim.type, Outcome.PROCESSED.value, "").inc()
        log.info("event processed", extra={**fields, "outcome": Outcome.PROCESSED.value})
        return Outcome.PROCESSED

    def _fail(self, claim: Claim, failure: Failure, fields: dict) -> Outcome:
        decision = self.policy.decide(failure, claim.tries)
        if isinstance(decision, GiveUp):
            record = FailureRecord(EventStatus.FAILED_PERMANENT, decision.reason, failure.error_class,
                                   failure.message)
        else:
            # Short delays ride a broker countdown; long ones are left to the sweep,
            # because a countdown past the broker's visibility timeout runs twice.
            scheduled = decision.delay_s <= MAX_COUNTDOWN_S and self.waker is not None
            record = FailureRecord(EventStatus.FAILED_RECOVERABLE, failure.reason, failure.error_class,
                                   failure.message, delay_s=decision.delay_s, wake_scheduled=scheduled)
        try:
            self.ledger.fail(claim, record)
        except LeaseLost:
            return self._lease_lost(claim, fields)
        if record.wake_scheduled:
            # After the failure is committed, so the wake-up never arrives before the row is due.
            self.waker.wake(claim.event_id, countdown_s=record.delay_s)
        outcome = Outcome(record.status.value)
        metrics.ATTEMPTS.labels(claim.type, outcome.value, record.reason).inc()
        if outcome is Outcome.FAILED_RECOVERABLE:
            metrics.RETRIES_SCHEDULED.labels(claim.type, record.reason).inc()
        log.warning("attempt failed", extra={**fields, "outcome": outcome.value, "reason": record.reason,
                                             "error_class": failure.error_class,
                                             "retry_in_s": record.delay_s})
        return outcome

    def _lease_lost(self, claim: Claim, fields: dict) -> Outcome:
        self.ledger.mark_lease_lost(claim, "lease expired and was taken over; this attempt rolled back")
        metrics.ATTEMPTS.labels(claim.type, Outcome.LEASE_LOST.value, "lease_lost").inc()
        log.warning("lease lost; attempt rolled back", extra={**fields, "outcome": Outcome.LEASE_LOST.value})
        return Outcome.LEASE_LOST
