"""The console's side of the ledger: the event list and its counts, the overview, failure groups,
replay jobs and the login throttle's failures (reconcile reports: ledger/reconcile_runs.py).
Statements: ledger/sql/console.sql; the event list, counts and replay are operations.sql's.

Events are chosen by ``ledger.event_query.EventQuery``. Pages are keyset pages newest first: ``after``
is the (received_at, id) of the last row shown.

A replay job is the set of events its filter matched when the operator confirmed it, fixed then
(``create_replay_job``); events arriving later or leaving the filter are never added. A console
process runs jobs batch by batch under a lease (``replay_next``); a cancel takes effect before the
next batch.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from psycopg import sql as pg_sql
from psycopg.rows import dict_row

from ledger.db import ProcessPool
from ledger.event_query import EventQuery, FilterError
from ledger.queries import SQL
from ledger.states import EventStatus
from ledger.statements import run_statement

MAX_PAGE = 200
COUNT_CAP = 10_000
MAX_REPLAY = 100_000
EXACT_PROCESSED_UP_TO = 50_000   # the overview counts processed events exactly up to this, then estimates


@dataclass
class Page:
    rows: list[dict[str, Any]]
    next_after: tuple[datetime, str] | None   # None: the last page


@dataclass(frozen=True)
class JobConfirmed:
    job_id: int | None     # None: nothing created, the filter matches ``matched`` events now
    matched: int
    already: bool = False  # the preview had been confirmed before: job_id is the job it made


@dataclass
class Overview:
    by_status: dict[str, int]
    processed_estimated: bool
    oldest_unprocessed_age_s: float | None
    due_retries: int
    expired_leases: int
    per_minute: list[dict[str, Any]]
    catchup_cursors: list[dict[str, Any]]
    health_alerts: list[dict[str, Any]]
    retention_runs: list[dict[str, Any]] = field(default_factory=list)
    retention_holds: int = 0
    outbox: dict[str, Any] | None = None
    queue_depth: int | None = None
    exact_up_to: int = EXACT_PROCESSED_UP_TO


class ConsoleLedger:
    def __init__(self, pool: ProcessPool):
        self._pool = pool

    def _all(self, statement: str | pg_sql.Composable, params: dict | None = None) -> list[dict[str, Any]]:
        return run_statement(self._pool, statement, params)

    # -- the event list --------------------------------------------------------------------------
    def page(self, query: EventQuery, *, size: int, after: tuple[datetime, str] | None = None) -> Page:
        size = max(1, min(size, MAX_PAGE))
        where, params = query.where(after)
        rows = self._all(pg_sql.SQL(SQL.events_page).format(where=where), {**params, "limit": size + 1})
        more = len(rows) > size
        rows = rows[:size]
        return Page(rows, (rows[-1]["received_at"], rows[-1]["id"]) if more else None)

    def count(self, query: EventQuery, *, cap: int = COUNT_CAP) -> tuple[int, bool]:
        """How many events match, and whether that is the cap (there are more)."""
        where, params = query.where()
        n = self._all(pg_sql.SQL(SQL.events_count_capped).format(where=where),
                      {**params, "cap": cap + 1})[0]["events"]
        return min(n, cap), n > cap

    # -- the overview ----------------------------------------------------------------------------
    def overview(self, *, health_alerts: list[dict[str, Any]]) -> Overview:
        unfinished = self._all(SQL.console_unfinished)[0]
        counts = {status.value: unfinished[status.value] for status in EventStatus
                  if status is not EventStatus.PROCESSED}
        processed = self._all(SQL.console_processed_count_capped, {"cap": EXACT_PROCESSED_UP_TO + 1})[0]["events"]
        estimated = processed > EXACT_PROCESSED_UP_TO
        if estimated:
            estimate = self._all(SQL.console_table_estimate)[0]["events"]
            processed = max(EXACT_PROCESSED_UP_TO, estimate - sum(counts.values()))
        counts[EventStatus.PROCESSED.value] = processed
        by_status = {s.value: counts.get(s.value, 0) for s in EventStatus}
        return Overview(by_status=by_status, processed_estimated=estimated,
                        oldest_unprocessed_age_s=(float(unfinished["oldest_unprocessed_age_s"])
                                                  if unfinished["oldest_unprocessed_age_s"] is not None else None),
                        due_retries=unfinished["due_retries"], expired_leases=unfinished["expired_leases"],
                        per_minute=self._all(SQL.console_per_minute),
                        catchup_cursors=self._all(SQL.console_catchup_cursors), health_alerts=health_alerts,
                        retention_runs=self._all(SQL.retention_runs_recent, {"limit": 5}),
                        retention_holds=len(self._all(SQL.retention_holds_active)))

    def failure_groups(self, *, limit: int = 200) -> list[dict[str, Any]]:
        return self._all(SQL.console_failure_groups, {"limit": limit})

    # -- one event -------------------------------------------------------------------------------
    def event_extras(self, event_id: str) -> dict[str, Any]:
        """What the console shows of an event beyond ``OperatorLedger.show``: every delivery with its
        source, the thin notification of a snapshot event, and its outbox effects."""
        params = {"id": event_id}
        payload = self._all(SQL.console_event_payload, params)
        return {"payload": payload[0]["payload"] if payload else None,
                "delivery_list": self._all(SQL.console_event_delivery_list, params),
                "thin_notifications": [r["event_id"] for r in self._all(SQL.console_event_thin_of, params)],
                "outbox": self._all(SQL.console_event_outbox, params)}

    # -- failed logins (ops/console/auth.py's throttle) -----------------------------------------------
    def login_failures(self, keys: list[str], *, window_s: float) -> dict[str, tuple[int, float]]:
        """Each key's failed logins within ``window_s`` and the seconds since its last one (keys with
        none are left out)."""
        rows = self._all(SQL.login_failures_recent, {"keys": keys, "window_s": window_s})
        return {row["key"]: (row["failures"], row["since_last_s"]) for row in rows}

    def record_login_failure(self, keys: list[str], *, window_s: float) -> None:
        self._all(SQL.login_failure_record, {"keys": keys, "window_s": window_s})

    def forget_login_failures(self, key: str) -> None:
        self._all(SQL.login_failures_forget, {"key": key})

    # -- replay jobs -----------------------------------------------------------------------------
    def replay_preview(self, query: EventQuery) -> int:
        """How many events a replay of ``query`` would replay now (at most MAX_REPLAY + 1)."""
        n, more = self.count(query, cap=MAX_REPLAY)
        return n + 1 if more else n

    def create_replay_job(self, query: EventQuery, *, expected: int, actor: str, reason: str | None,
                          force: bool, preview_id: uuid.UUID) -> JobConfirmed:
        """Create the job a confirmed preview asked for, once: nothing when the filter matches another
        count than ``expected`` now, and the job already made when this preview was confirmed before."""
        if expected > MAX_REPLAY:
            raise FilterError(f"a replay covers at most {MAX_REPLAY} events: narrow the filter")
        where, params = query.where()
        statement = pg_sql.SQL(SQL.replay_job_create).format(where=where)
        try:
            with self._pool.get().connection() as conn, conn.transaction():
                job_id, total = conn.execute(statement, {
                    **params, "actor": actor, "job_reason": reason, "force": force, "expected": expected,
                    "filter": json.dumps(query.as_json()), "preview_id": preview_id}).fetchone()
                if job_id is None:
                    job_id, total = conn.execute(SQL.replay_job_of_preview, {"preview_id": preview_id}).fetchone()
                    return JobConfirmed(job_id, total, already=True)
                if total != expected:
                    raise _SetChanged(total)  # rolls the job back
        except _SetChanged as changed:
            return JobConfirmed(None, changed.args[0])
        return JobConfirmed(job_id, total)

    def claim_replay_job(self, *, runner: str, lease_s: float) -> dict[str, Any] | None:
        rows = self._all(SQL.replay_job_claim, {"runner": runner, "lease_s": lease_s})
        return rows[0] if rows else None

    def replay_next(self, job_id: int, *, runner: str, batch: int, lease_s: float) -> tuple[str | None, list[str]]:
        """Replay the job's next batch, in one transaction: the job's status after it (None: no longer
        ours, or cancelled before it) and the ids replayed, to wake once this returns (committed)."""
        with self._pool.get().connection() as conn, conn.transaction():
            cursor = conn.cursor(row_factory=dict_row)
            job = cursor.execute(SQL.replay_job_take_batch, {"job_id": job_id, "runner": runner,
                                                             "batch": batch}).fetchone()
            if job is None:
                return None, []
            replayed = [event_id for event_id in job["event_ids"] if cursor.execute(
                SQL.event_replay_if_finished_or_failed,
                {"id": event_id, "actor": job["actor"], "reason": job["reason"], "force": job["force"],
                 "expected_status": job["expected_status"], "replay_job_id": job_id}).fetchone()]
            status = cursor.execute(SQL.replay_job_record_batch, {
                "job_id": job_id, "replayed": replayed, "reached": job["event_ids"], "lease_s": lease_s,
            }).fetchone()["status"]
        return status, replayed

    def cancel_replay_job(self, job_id: int, *, actor: str) -> bool:
        return bool(self._all(SQL.replay_job_cancel, {"id": job_id, "actor": actor}))

    def replay_job(self, job_id: int) -> dict[str, Any] | None:
        rows = self._all(SQL.replay_job_get, {"id": job_id})
        return rows[0] if rows else None

    def replay_jobs(self, *, limit: int = 20) -> list[dict[str, Any]]:
        return self._all(SQL.replay_jobs_recent, {"limit": limit})


class _SetChanged(Exception):
    """The filter matched another count than the one confirmed."""
