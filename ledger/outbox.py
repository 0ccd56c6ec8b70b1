"""The outbox's side of the ledger: record (inside the apply transaction), claim,
finish, fail, sweep, rescue, and the operator's list/show/replay.

Statements are named SQL (ledger/sql/outbox.sql); outside the apply transaction
they run through ledger.statements.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import psycopg
from psycopg.types.json import Jsonb

from ledger.db import ProcessPool
from ledger.errors import LeaseLost
from ledger.liveness import Liveness, Probe, probe
from ledger.queries import SQL
from ledger.states import OutboxStatus
from ledger.statements import run_statement


@dataclass(frozen=True)
class EffectClaim:
    """One delivery attempt of one recorded effect, owned until the lease expires."""
    id: int
    idempotency_key: str
    effect: str
    event_id: str
    ordering_key: str | None
    payload: dict[str, Any]
    attempt: int
    tries: int
    lease_owner: str


def record(conn: psycopg.Connection, *, idempotency_key: str, effect: str, event_id: str,
           ordering_key: str | None, payload: dict[str, Any]) -> int | None:
    """Record an effect on the apply transaction's connection; None if the key was already recorded."""
    if ordering_key is not None:
        conn.execute(SQL.outbox_lock_ordering_key, {"ordering_key": ordering_key})
    row = conn.execute(SQL.outbox_record, {"idempotency_key": idempotency_key, "effect": effect,
                                           "event_id": event_id, "ordering_key": ordering_key,
                                           "payload": Jsonb(payload)}).fetchone()
    return row[0] if row else None


class OutboxLedger:
    def __init__(self, pool: ProcessPool, *, liveness: Liveness | None = None):
        self._pool = pool
        # The dispatcher process's proof of life (ledger/liveness.py), stamped on its claims.
        self._liveness = liveness

    def _all(self, sql: str, params: dict) -> list[dict[str, Any]]:
        return run_statement(self._pool, sql, params)

    def claim(self, outbox_id: int, *, lease_s: int) -> EffectClaim | None:
        lease_owner = uuid.uuid4().hex
        rows = self._all(SQL.outbox_claim, {"id": outbox_id, "lease_owner": lease_owner, "lease_s": lease_s,
                                            "liveness_key": self._liveness.key() if self._liveness else None})
        if not rows:
            return None
        row = rows[0]
        return EffectClaim(id=row["id"], idempotency_key=row["idempotency_key"], effect=row["effect"],
                           event_id=row["event_id"], ordering_key=row["ordering_key"], payload=row["payload"],
                           attempt=row["attempts"], tries=row["tries"], lease_owner=lease_owner)

    def finish(self, claim: EffectClaim) -> None:
        if not self._all(SQL.outbox_finish_if_lease_held, {"id": claim.id, "lease_owner": claim.lease_owner}):
            raise LeaseLost()

    def fail(self, claim: EffectClaim, *, status: OutboxStatus, reason: str, error: str, delay_s: float | None,
             wake_scheduled: bool) -> None:
        params = {"id": claim.id, "lease_owner": claim.lease_owner, "status": OutboxStatus(status).value,
                  "reason": reason, "error": error[:2000], "delay_s": delay_s, "wake_scheduled": wake_scheduled}
        if not self._all(SQL.outbox_fail_if_lease_held, params):
            raise LeaseLost()

    def rescue_owners_gone(self) -> Probe:
        """Take over the leases of effects whose dispatcher is gone (outbox_rescue_if_owner_gone)."""
        return probe(self._all(SQL.outbox_rescue_if_owner_gone, {}), "outbox_id")

    def take_overdue_wakeups(self, *, overdue_s: float, batch: int) -> list[int]:
        return [r["id"] for r in self._all(SQL.outbox_sweep_overdue_wakeups,
                                           {"overdue_s": overdue_s, "batch": batch})]

    def list(self, *, status: OutboxStatus | None, effect_like: str | None, limit: int) -> list[dict[str, Any]]:
        return self._all(SQL.outbox_list, {"status": status, "effect_like": effect_like, "limit": limit})

    def get(self, outbox_id: int) -> dict[str, Any] | None:
        rows = self._all(SQL.outbox_get, {"id": outbox_id})
        return rows[0] if rows else None

    def ids_for_replay(self, *, status: OutboxStatus, effect_like: str | None, page: int = 500) -> Iterator[int]:
        after = 0
        while True:
            rows = self._all(SQL.outbox_select_for_replay,
                             {"status": status, "effect_like": effect_like, "after": after, "limit": page})
            yield from (r["id"] for r in rows)
            if len(rows) < page:
                return
            after = rows[-1]["id"]

    def replay(self, outbox_id: int, *, force: bool) -> bool:
        return bool(self._all(SQL.outbox_replay_if_failed, {"id": outbox_id, "force": force}))

    def stats(self) -> dict[str, Any]:
        row = self._all(SQL.outbox_stats, {})[0]
        age = row["oldest_unsent_age_s"]
        return {"depth": row["depth"], "failed_permanent": row["failed_permanent"],
                "oldest_unsent_age_s": float(age) if age is not None else None}
