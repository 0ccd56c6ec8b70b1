"""Delivering one recorded effect: claim, call the sender with the idempotency key, finish or fail.

The event ledger never waits on this: effects are recorded with the business
writes and delivered afterwards, by their own tasks, on their own retry schedule.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ledger.outbox import EffectClaim, OutboxLedger
from ledger.store import LeaseLost
from workers import metrics
from workers.app import MAX_COUNTDOWN_S
from workers.effects import DeliveryFailed, EffectDelivery, Sender
from workers.failures import Failure, Kind
from workers.processor import Outcome
from workers.retry import GiveUp, RetryPolicy
from workers.wakeup import Waker

log = logging.getLogger(__name__)

SENT = "sent"


@dataclass
class OutboxDispatcher:
    ledger: OutboxLedger
    senders: dict[str, Sender]
    policy: RetryPolicy
    waker: Waker | None
    lease_s: int

    def dispatch(self, outbox_id: int) -> str:
        claim = self.ledger.claim(outbox_id, lease_s=self.lease_s)
        if claim is None:
            return Outcome.NOT_CLAIMED.value
        fields = {"outbox_id": claim.id, "effect": claim.effect, "event_id": claim.event_id,
                  "attempt": claim.attempt}
        if claim.tries > self.policy.max_attempts:
            # Only reachable through lease rescues: a dispatcher keeps dying on this effect.
            return self._fail(claim, Failure(Kind.PERMANENT, "retries_exhausted", "LeaseExpired",
                                             "every attempt ended with its dispatcher gone"), None, fields)
        sender = self.senders.get(claim.effect)
        if sender is None:
            return self._fail(claim, Failure(Kind.PERMANENT, "no_sender", "NoSender",
                                             f"no sender configured for effect {claim.effect}"), None, fields)
        try:
            sender(EffectDelivery(sequence=claim.id, idempotency_key=claim.idempotency_key, effect=claim.effect,
                                  event_id=claim.event_id, ordering_key=claim.ordering_key, payload=claim.payload))
        except DeliveryFailed as exc:
            kind = Kind.PERMANENT if exc.permanent else Kind.RECOVERABLE
            return self._fail(claim, Failure(kind, exc.reason, type(exc).__name__, str(exc)), exc.retry_after_s,
                              fields)
        except Exception as exc:  # a custom sender's own error: retrying is the safe default
            return self._fail(claim, Failure(Kind.RECOVERABLE, "unexpected_error", type(exc).__name__,
                                             str(exc)[:500]), None, fields)
        try:
            self.ledger.finish(claim)
        except LeaseLost:
            # Another dispatcher re-claimed after our lease expired; both calls carried
            # the same idempotency key, so the receiving side applied it once.
            log.warning("effect sent but lease lost", extra={**fields, "outcome": "lease_lost"})
            return Outcome.LEASE_LOST.value
        metrics.OUTBOX_SENT.labels(claim.effect).inc()
        log.info("effect sent", extra={**fields, "outcome": SENT})
        return SENT

    def _fail(self, claim: EffectClaim, failure: Failure, retry_after_s: float | None, fields: dict) -> str:
        decision = self.policy.decide(failure, claim.tries)
        if isinstance(decision, GiveUp):
            status, delay, scheduled = "failed_permanent", None, False
            metrics.OUTBOX_FAILED.labels(claim.effect, decision.reason).inc()
            reason = decision.reason
        else:
            status, reason = "failed_recoverable", failure.reason
            delay = max(decision.delay_s, retry_after_s or 0.0)
            scheduled = delay <= MAX_COUNTDOWN_S and self.waker is not None
            metrics.OUTBOX_RETRIES.labels(claim.effect, reason).inc()
        try:
            self.ledger.fail(claim, status=status, reason=reason, error=failure.message, delay_s=delay,
                             wake_scheduled=scheduled)
        except LeaseLost:
            return Outcome.LEASE_LOST.value
        if scheduled:
            self.waker.wake_effect(claim.id, countdown_s=delay)
        log.warning("effect delivery failed", extra={**fields, "outcome": status, "reason": reason,
                                                     "retry_in_s": delay})
        return status
