"""The operator's side of the ledger (ledgerctl): inspect, replay, prune.

Replay runs the same kind of guarded compare-and-set as the workers: it can
only move an event that nobody is working on. Statements are named SQL
(ledger/sql/operations.sql, events.sql, thin.sql), run through ledger.statements.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator

from psycopg import sql as pg_sql

from ledger.db import ProcessPool
from ledger.event_query import EventQuery
from ledger.queries import SQL
from ledger.statements import run_statement


class OperatorLedger:
    def __init__(self, pool: ProcessPool):
        self._pool = pool

    def _all(self, sql: str, params: dict | None = None) -> list[dict[str, Any]]:
        return run_statement(self._pool, sql, params)

    def stats(self) -> dict[str, Any]:
        by_status_type = self._all(SQL.stats_by_status_and_type)
        unfinished = self._all(SQL.stats_unfinished)[0]
        by_status: dict[str, int] = {}
        for row in by_status_type:
            by_status[row["status"]] = by_status.get(row["status"], 0) + row["events"]
        age = unfinished["oldest_unprocessed_age_s"]
        return {"by_status": by_status, "by_status_and_type": by_status_type,
                "oldest_unprocessed_age_s": float(age) if age is not None else None,
                **{k: unfinished[k] for k in ("unfinished", "due_retries", "scheduled_retries",
                                              "expired_leases", "in_progress")}}

    def health_alerts(self, limit: int) -> list[dict[str, Any]]:
        """Stripe's event generation failures (ledger.health_alerts), newest first."""
        return self._all(SQL.health_alerts_recent, {"limit": limit})

    def list_events(self, query: EventQuery, limit: int) -> list[dict[str, Any]]:
        """The newest ``limit`` events ``query`` chooses (the console's first page)."""
        where, params = query.where()
        return self._all(pg_sql.SQL(SQL.events_page).format(where=where), {**params, "limit": limit})

    def show(self, event_id: str) -> dict[str, Any] | None:
        """The event's row, deliveries, attempts, audit, and the snapshot events a thin notification was
        applied under (the ids its business rows carry: workers.billing.reads reads those rows)."""
        params = {"id": event_id}
        rows = self._all(SQL.event_get, params)
        if not rows:
            return None
        return {"event": rows[0], "deliveries": self._all(SQL.event_deliveries, params)[0],
                "attempts": self._all(SQL.event_attempts, params), "audit": self._all(SQL.event_audit, params),
                "snapshot_twins": [row["snapshot_event_id"] for row in self._all(SQL.event_snapshot_twins, params)]}

    def object_events(self, object_id: str) -> list[dict[str, Any]]:
        """The events of one Stripe object (``own``) and, for a customer, of its other objects, in Stripe's
        order, each with its payload, deliveries and replays (``ledgerctl objects show``)."""
        return self._all(SQL.object_events, {"id": object_id})

    def ids_for_replay(self, query: EventQuery, *, page: int = 500) -> Iterator[str]:
        where, params = query.where()
        statement = pg_sql.SQL(SQL.events_ids_after).format(where=where)
        after = ""
        while True:
            rows = self._all(statement, {**params, "after": after, "limit": page})
            for row in rows:
                yield row["id"]
            if len(rows) < page:
                return
            after = rows[-1]["id"]

    def replay(self, event_id: str, *, actor: str, reason: str | None, force: bool) -> str | None:
        """Move one event back to received; its previous status, or None if it was not replayable."""
        rows = self._all(SQL.event_replay_if_finished_or_failed,
                         {"id": event_id, "actor": actor, "reason": reason, "force": force, "expected_status": None,
                          "replay_job_id": None})
        return rows[0]["from_status"] if rows else None


    def replay_paced(self, event_ids: Iterable[str], *, actor: str, reason: str | None, force: bool,
                     rate_per_s: float, wake: Callable[[str], Any]) -> tuple[list[dict[str, str]], list[str]]:
        """``replay`` each event, at most ``rate_per_s`` a second, and ``wake`` each one replayed (after its
        replay committed): a bulk replay feeds the workers at a pace, never a flood. The replayed, as
        {"id", "from_status"}, and the ids skipped (``replay`` returned None)."""
        replayed: list[dict[str, str]] = []
        skipped: list[str] = []
        interval = 1.0 / rate_per_s
        next_at = time.monotonic()
        for event_id in event_ids:
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            next_at = max(next_at, time.monotonic()) + interval
            from_status = self.replay(event_id, actor=actor, reason=reason, force=force)
            if from_status is None:
                skipped.append(event_id)
                continue
            wake(event_id)
            replayed.append({"id": event_id, "from_status": from_status})
        return replayed, skipped
    def count_prunable(self, *, older_than_s: float) -> int:
        return self._all(SQL.events_count_prunable, {"older_than_s": older_than_s})[0]["prunable"]

    def prune_payloads(self, *, older_than_s: float, batch: int = 1000) -> Iterator[int]:
        """Prune in batches; yields the size of each batch until none is left."""
        while True:
            pruned = len(self._all(SQL.events_prune_payloads, {"older_than_s": older_than_s, "batch": batch}))
            if not pruned:
                return
            yield pruned
