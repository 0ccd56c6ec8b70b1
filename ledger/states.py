"""The ledger's state machines, each declared once: events and outbox effects.

Events (ledger.events.status)::

    received ──claim──▶ processing ──finish──▶ processed
        ▲                  │  │
        │                  │  └──fail (permanent, or retries exhausted)──▶ failed_permanent
        │                  └──fail (recoverable)──▶ failed_recoverable
        │                  ▲                              │
        │                  └──claim when due─────────────┘
        └── replay (ledgerctl) from failed_* / processed

Outbox effects (ledger.outbox.status), the same machine under other names::

    pending ──claim──▶ sending ──finish──▶ sent
                         └──fail──▶ failed_recoverable (claimed again when due) | failed_permanent
    replay (ledgerctl outbox replay) from failed_* / sent ──▶ pending

A ``processing`` (``sending``) row whose lease expired is claimable again (its
worker died). The database enforces the same sets with CHECK constraints on
ledger.events.status (migration 0001) and ledger.outbox.status (migration 0004).
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


class OutboxStatus(StrEnum):
    # In: a handler's ctx.emit, committed with the business writes; replay. Out: a dispatcher's claim.
    PENDING = "pending"
    # In: a dispatcher's claim (with a lease). Out: finish, fail, or a re-claim once the lease expired.
    SENDING = "sending"
    # In: finish, after the sender returned. Terminal (ledgerctl outbox replay --force only).
    SENT = "sent"
    # In: a recoverable delivery failure, with next_attempt_at. Out: a claim once due; replay.
    FAILED_RECOVERABLE = "failed_recoverable"
    # In: a permanent failure (rejected, no sender) or exhausted retries, with a reason. Out: replay only.
    FAILED_PERMANENT = "failed_permanent"
