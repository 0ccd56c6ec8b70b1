"""Delivering one recorded effect: claim, call the sender with the idempotency key, finish or fail.

The path of an attempt (retries exhausted, fail, lease lost) is workers.attempt's,
shared with event processing; what is the effect's own is here: the sender is
called outside any transaction, a Retry-After it reports is honoured, and its
metrics. The event ledger never waits on this: effects are recorded with the
business writes and delivered afterwards, by their own tasks, on their own
retry schedule.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

from ledger.errors import LeaseLost
from ledger.outbox import EffectClaim, OutboxLedger
from ledger.states import OutboxStatus
from ledger.attempts import FailureRecord
from workers import metrics
from workers.attempt import LeasedWork, outcomes
from workers.effects import DeliveryFailed, EffectDelivery, Sender
from workers.failures import Failure, Kind
from workers.retry import RetryPolicy
from workers.wakeup import Waker

log = logging.getLogger(__name__)

DispatchOutcome = outcomes("DispatchOutcome", __name__, OutboxStatus.SENT, OutboxStatus.FAILED_RECOVERABLE,
                           OutboxStatus.FAILED_PERMANENT)


@dataclass
class OutboxDispatcher(LeasedWork):
    ledger: OutboxLedger
    senders: dict[str, Sender]
    policy: RetryPolicy
    waker: Waker | None
    lease_s: int

    status = OutboxStatus
    finished = OutboxStatus.SENT
    outcome = DispatchOutcome
    abandoned = "every attempt ended with its dispatcher gone"

    def dispatch(self, outbox_id: int) -> DispatchOutcome:
        claim = self.ledger.claim(outbox_id, lease_s=self.lease_s)
        if claim is None:
            return DispatchOutcome.NOT_CLAIMED
        fields = {"outbox_id": claim.id, "effect": claim.effect, "event_id": claim.event_id,
                  "attempt": claim.attempt}
        try:
            # The first of: refused, retries exhausted, how the delivery failed (None: it was sent).
            result: Failure | LeaseLost | None = self._refused(claim) or self._deliver(claim)
        except LeaseLost as lost:
            result = lost
        return self._conclude(claim, result, fields)

    def _refusal(self, claim: EffectClaim) -> Failure | None:
        if claim.effect not in self.senders:
            return Failure(Kind.PERMANENT, "no_sender", "NoSender", f"no sender configured for effect {claim.effect}")
        return None

    def _deliver(self, claim: EffectClaim) -> Failure | None:
        """Call the sender, then finish under the lease; its failure, classified where it was caught.
        Raises LeaseLost when the finish finds the lease taken over."""
        sender = self.senders[claim.effect]
        try:
            sender(EffectDelivery(sequence=claim.id, idempotency_key=claim.idempotency_key, effect=claim.effect,
                                  event_id=claim.event_id, ordering_key=claim.ordering_key, payload=claim.payload))
        except DeliveryFailed as exc:
            return Failure(Kind.PERMANENT if exc.permanent else Kind.RECOVERABLE, exc.reason, type(exc).__name__,
                           str(exc), retry_after_s=exc.retry_after_s)
        except Exception as exc:  # a custom sender's own error: retrying is the safe default
            return Failure(Kind.RECOVERABLE, "unexpected_error", type(exc).__name__, str(exc)[:500])
        self.ledger.finish(claim)
        return None

    def _record_failure(self, claim: EffectClaim, record: FailureRecord) -> None:
        self.ledger.fail(claim, status=record.status, reason=record.reason, error=record.error,
                         delay_s=record.delay_s, wake_scheduled=record.wake_scheduled)

    def _wake(self, claim: EffectClaim, countdown_s: float) -> None:
        self.waker.wake_effect(claim.id, countdown_s=countdown_s)

    def _on_done(self, claim: EffectClaim, fields: dict) -> None:
        metrics.OUTBOX_SENT.labels(claim.effect).inc()
        log.info("effect sent", extra={**fields, "outcome": DispatchOutcome.SENT.value})

    def _on_failure(self, claim: EffectClaim, outcome: StrEnum, record: FailureRecord, fields: dict) -> None:
        counter = metrics.OUTBOX_RETRIES if outcome is DispatchOutcome.FAILED_RECOVERABLE else metrics.OUTBOX_FAILED
        counter.labels(claim.effect, record.reason).inc()
        log.warning("effect delivery failed", extra={**fields, "outcome": outcome.value,
                                                     "reason": record.reason, "retry_in_s": record.delay_s})

    def _on_lease_lost(self, claim: EffectClaim, fields: dict) -> None:
        # Another dispatcher re-claimed after our lease expired. If our call went out, both
        # carried the same idempotency key, so the receiving side applied it once.
        log.warning("lease lost; another dispatcher has the effect",
                    extra={**fields, "outcome": DispatchOutcome.LEASE_LOST.value})
