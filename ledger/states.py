"""The event state machine, declared once.

    received ──claim──▶ processing ──finish──▶ processed
        ▲                  │  │
        │                  │  └──fail (permanent, or retries exhausted)──▶ failed_permanent
        │                  └──fail (recoverable)──▶ failed_recoverable
        │                  ▲                              │
        │                  └──claim when due─────────────┘
        └── replay (ledgerctl) from failed_* / processed

A ``processing`` row whose lease expired is claimable again (its worker died).
The database enforces the same set with a CHECK constraint on ledger.events.status.
"""
from __future__ import annotations

from enum import StrEnum


class EventStatus(StrEnum):
    # In: the receiver's INSERT; replay. Out: a worker's claim.
    RECEIVED = "received"
    # In: a worker's claim (with a lease). Out: finish, fail, or a re-claim once the lease expired.
    PROCESSING = "processing"
    # In: finish, in the same transaction as the business writes. Terminal (replay --force only).
    PROCESSED = "processed"
    # In: a recoverable failure, with next_attempt_at. Out: a claim once due; redelivery makes it due now.
    FAILED_RECOVERABLE = "failed_recoverable"
    # In: a permanent failure or exhausted retries, with a reason. Out: replay only.
    FAILED_PERMANENT = "failed_permanent"

    @property
    def is_finished(self) -> bool:
        """A redelivery of a finished event is acknowledged and ignored."""
        return self in (EventStatus.PROCESSED, EventStatus.FAILED_PERMANENT)
