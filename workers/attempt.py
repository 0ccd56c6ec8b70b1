"""One attempt at leased work, the path events (workers/processor.py) and effects
(workers/dispatcher.py) share once a claim is theirs::

    refused (no handler, no sender) ──┐
    retries exhausted ────────────────┤
    work, then finish ── failed ──────┴─▶ fail ─▶ failed_permanent
          │                                   └─▶ failed_recoverable (woken when due)
          └─▶ done
    the lease taken over, at any step ──▶ lease lost (nothing of ours committed)

``LeasedWork`` holds the rules both sides follow; a subclass supplies what is its
own (the hooks at the end: the ledger it records in, its wake-ups, metrics and
logs). An attempt is its work between two halves, ``_refused`` before it and
``_conclude`` after it, which each side runs around its own work: an effect's
delivery (OutboxDispatcher.dispatch), or the apply transactions of the events a
worker claimed together (EventProcessor.process_batch), for each claim on its own.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from enum import StrEnum
from typing import ClassVar

from ledger.errors import LeaseLost
from ledger.outbox import EffectClaim
from ledger.states import EventStatus, OutboxStatus
from ledger.attempts import Claim, FailureRecord
from workers.app import MAX_COUNTDOWN_S
from workers.failures import Failure, Kind
from workers.retry import GiveUp, RetryPolicy
from workers.wakeup import Waker


def outcomes(name: str, module: str, *finished: EventStatus | OutboxStatus) -> type[StrEnum]:
    """The outcomes of an attempt: a status it leaves the row in (``finished``), or
    ``NOT_CLAIMED`` (another worker has it, it is done, or it is not due) or
    ``LEASE_LOST`` (our lease was taken over; nothing of ours committed)."""
    members = {status.name: status.value for status in finished}
    members.update(NOT_CLAIMED="not_claimed", LEASE_LOST="lease_lost")
    return StrEnum(name, members, module=module)


# An attempt's claim: an event's (ledger.attempts) or an effect's (ledger.outbox).
AnyClaim = Claim | EffectClaim


class LeasedWork(ABC):
    """The two halves of an attempt, once a claim is ours, by the rules above; see the hooks below."""

    policy: RetryPolicy
    waker: Waker | None
    # The row's states, the status a finished attempt leaves it in, the attempt's outcomes (see ``outcomes``).
    status: ClassVar[type[EventStatus] | type[OutboxStatus]]
    finished: ClassVar[EventStatus | OutboxStatus]
    outcome: ClassVar[type[StrEnum]]
    # last_error of an attempt refused because every earlier one ended with its worker gone.
    abandoned: ClassVar[str]

    def _refused(self, claim: AnyClaim) -> Failure | None:
        """Why the attempt fails before any work: refused (``_refusal``), or retries exhausted."""
        return self._refusal(claim) or self._exhausted(claim)

    def _conclude(self, claim: AnyClaim, result: Failure | LeaseLost | None, fields: dict) -> StrEnum:
        """End an attempt once its work is over: ``result`` is how it failed, LeaseLost, or None
        (the work finished and committed). Records the failure and schedules its retry, or notes
        the lost lease; then the side's metrics and log line."""
        if isinstance(result, LeaseLost):
            return self._lease_lost(claim, fields)
        if result is not None:
            return self._fail(claim, result, fields)
        self._on_done(claim, fields)
        return self.outcome(self.finished)

    def _exhausted(self, claim: AnyClaim) -> Failure | None:
        if claim.tries > self.policy.max_attempts:
            # Only reachable through lease rescues: a worker keeps dying on this one.
            return Failure(Kind.PERMANENT, "retries_exhausted", "LeaseExpired", self.abandoned)
        return None

    def _fail(self, claim: AnyClaim, failure: Failure, fields: dict) -> StrEnum:
        decision = self.policy.decide(failure, claim.tries)
        if isinstance(decision, GiveUp):
            record = FailureRecord(self.status.FAILED_PERMANENT, decision.reason, failure.error_class,
                                   failure.message)
        else:
            # Never sooner than the other side asked (Retry-After).
            delay_s = max(decision.delay_s, failure.retry_after_s or 0.0)
            # Short delays ride a broker countdown; long ones are left to the sweep,
            # because a countdown past the broker's visibility timeout runs twice.
            scheduled = delay_s <= MAX_COUNTDOWN_S and self.waker is not None
            record = FailureRecord(self.status.FAILED_RECOVERABLE, failure.reason, failure.error_class,
                                   failure.message, delay_s=delay_s, wake_scheduled=scheduled)
        try:
            self._record_failure(claim, record)
        except LeaseLost:
            return self._lease_lost(claim, fields)
        if record.wake_scheduled:
            # After the failure is committed, so the wake-up never arrives before the row is due.
            self._wake(claim, record.delay_s)
        outcome = self.outcome(record.status)
        self._on_failure(claim, outcome, record, fields)
        return outcome

    def _lease_lost(self, claim: AnyClaim, fields: dict) -> StrEnum:
        self._on_lease_lost(claim, fields)
        return self.outcome.LEASE_LOST

    # -- what each side supplies -------------------------------------------------------------

    @abstractmethod
    def _refusal(self, claim: AnyClaim) -> Failure | None:
        """Why no attempt can succeed, known from the claim alone (no handler, no sender). Checked
        before retries exhausted: it is the reason an operator can act on."""

    @abstractmethod
    def _record_failure(self, claim: AnyClaim, record: FailureRecord) -> None:
        """Record the failed attempt in the ledger; raises LeaseLost if the lease is no longer ours."""

    @abstractmethod
    def _wake(self, claim: AnyClaim, countdown_s: float) -> None:
        """Schedule the retry's wake-up."""

    # After each outcome: the side's metrics and log line (and, for a lost lease, its own note).

    @abstractmethod
    def _on_done(self, claim: AnyClaim, fields: dict) -> None: ...

    @abstractmethod
    def _on_failure(self, claim: AnyClaim, outcome: StrEnum, record: FailureRecord, fields: dict) -> None: ...

    @abstractmethod
    def _on_lease_lost(self, claim: AnyClaim, fields: dict) -> None: ...
