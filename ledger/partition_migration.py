"""The online migration of a ledger that had events before migration 0012 (``ledgerctl partitions
migrate``; docs/retention.md, "Moving an existing ledger").

The receiver and the workers keep running throughout. The steps, each resumable:

1. **Twins.** ``ledger.events_partitioned`` and the two tables partitioned with it, shaped from the
   tables themselves, with a partition for every month that has events and the months ahead.
2. **Mirror.** Triggers on the tables write every insert, update and delete to the twins from one
   commit on (``mirrored_from``). Made in one short transaction that waits at most ``LOCK_MS`` for
   the writers in flight, retried.
3. **Backfill**, in batches of ``BATCH``: events by id, attempts by key (both locked FOR KEY SHARE
   while copied: a concurrent delete waits, a concurrent update's trigger leaves the newer row),
   deliveries recorded before ``mirrored_from`` by heap slice (those after are the triggers').
   Then every table naming an event gets its event_created, under a CHECK validated before the swap.
   A batch gives way to the writers: it waits at most ``BATCH_LOCK_MS`` for a lock, well inside
   Postgres' deadlock_timeout, then rolls back and runs again. A writer's trigger may be waiting for
   the copies the batch made while the batch waits for that writer's row (a sweep's redrive, a
   retention delete); the batch, not the writer, is the one that goes.
4. **Verify**: each table's rows counted with its twin's in one snapshot, without a lock (a write and
   its mirror commit together); a difference refuses the swap.
5. **Swap**, in one transaction: the tables and those naming events locked exclusively, events
   first as every writer takes them (waiting at most ``LOCK_MS``, then retried), set aside and the twins renamed into place. Its lock is the only wait a writer sees.
   Names only (the tables set aside as ``<name>_before_partitions``): no row is read or written.
6. **Cleanup**: the tables set aside dropped (unlinking their files takes a while, under locks
   nobody else needs), locked first, events first, waiting at most ``LOCK_MS``: a statement
   prepared before the swap still locks them, in that order, before it is planned again.

``abort`` drops the twins and the triggers before a swap; the tables are as they were.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from psycopg import IsolationLevel, errors, sql as pgsql
from psycopg.rows import dict_row

from ledger.db import ProcessPool, session_lock
from ledger.errors import MigrationError
from ledger.partitions import AHEAD
from ledger.queries import SQL
from ledger.statements import run_statement

BATCH = 5000
# Deliveries' heap blocks (8 KB) per backfill statement.
SLICE_BLOCKS = 1024
# The longest a step that needs the tables' locks waits for them (a writer queues behind it
# meanwhile), and how often it tries.
LOCK_MS = 500
LOCK_TRIES = 20
# A backfill batch's longest wait for a writer's lock (then it rolls back and runs again), and how
# often it runs again before the migration stops (resumable) and says which writer kept the rows.
BATCH_LOCK_MS = 100
BATCH_TRIES = 200
# What a step that gave way met: a lock wait it gave up, or a deadlock Postgres broke on it.
GAVE_WAY = (errors.LockNotAvailable, errors.DeadlockDetected)


class AnotherMigration(Exception):
    """Another process is migrating this ledger."""


@dataclass
class MigrationReport:
    status: str                       # done | already (partitioned before) | aborted
    events: int = 0
    attempts: int = 0
    deliveries: int = 0
    dependents: int = 0
    seconds: float = 0.0
    swap_s: float = 0.0               # the swap transaction: the tables' exclusive lock, held
    lock_waits: int = 0               # lock timeouts met (each a wait of LOCK_MS at most)
    gave_way: int = 0                 # backfill batches rolled back for a writer, then run again
    phases: dict[str, float] = field(default_factory=dict)


class PartitionMigration:
    def __init__(self, pool: ProcessPool, *, batch: int = BATCH,
                 progress: Callable[[str, int], None] | None = None):
        self._pool = pool
        self._batch_size = batch
        self._progress = progress or (lambda phase, done: None)

    def _all(self, statement, params: dict | None = None) -> list[dict[str, Any]]:
        return run_statement(self._pool, statement, params)

    def state(self) -> dict[str, Any]:
        return self._all(SQL.partition_migration_state)[0]

    def run(self) -> MigrationReport:
        started = time.monotonic()
        with session_lock(self._pool.settings, SQL.partition_migration_try_lock, SQL.partition_migration_unlock,
                          name="ledger-partition-migration") as held:
            if not held:
                raise AnotherMigration("another process is migrating this ledger to partitions")
            state = self.state()
            if state["partitioned"]:
                self._with_lock(MigrationReport("already"), self._cleanup)  # stopped between swap and cleanup
                return MigrationReport("already")
            report = MigrationReport("running")
            since = state["mirrored_from"]
            if state["phase"] is None:
                self._timed(report, "twins", self._make_twins)
                since = self._timed(report, "mirror", lambda: self._with_lock(report, self._mirror))
            self._timed(report, "events", lambda: self._backfill_events(report))
            self._timed(report, "deliveries", lambda: self._backfill_deliveries(report, since))
            self._timed(report, "attempts", lambda: self._backfill_attempts(report))
            self._timed(report, "dependents", lambda: self._backfill_dependents(report))
            self._timed(report, "verify", self._verify)
            self._timed(report, "swap", lambda: self._with_lock(report, lambda: self._swap(report)))
            self._timed(report, "cleanup", lambda: self._with_lock(report, self._cleanup))
            report.status = "done"
            report.seconds = time.monotonic() - started
            return report

    def abort(self) -> MigrationReport:
        with session_lock(self._pool.settings, SQL.partition_migration_try_lock, SQL.partition_migration_unlock,
                          name="ledger-partition-migration") as held:
            if not held:
                raise AnotherMigration("another process is migrating this ledger to partitions")
            if self.state()["partitioned"]:
                raise MigrationError("the ledger is partitioned already: there is nothing to abort")
            self._all(SQL.partition_migration_abort)
            return MigrationReport("aborted")

    # -- the steps ----------------------------------------------------------------------------

    @staticmethod
    def _timed(report: MigrationReport, phase: str, step: Callable[[], Any]) -> Any:
        started = time.monotonic()
        try:
            return step()
        finally:
            report.phases[phase] = round(report.phases.get(phase, 0.0) + time.monotonic() - started, 3)

    def _make_twins(self) -> None:
        months = [row["month"] for row in self._all(SQL.partition_migration_months, {"ahead": AHEAD})]
        self._all(SQL.partition_migration_twins, {"months": months})

    def _mirror(self):
        return self._all(SQL.partition_migration_mirror, {"lock_ms": LOCK_MS})[0]["since"]

    def _with_lock(self, report: MigrationReport, step: Callable[[], Any]) -> Any:
        for attempt in range(LOCK_TRIES):
            try:
                return step()
            except GAVE_WAY:
                # A transaction on the tables held on: let it end, then wait again (never longer than LOCK_MS).
                report.lock_waits += 1
                time.sleep(min(2.0, LOCK_MS / 1000 * (attempt + 1)))
        raise MigrationError(f"the ledger's tables stayed locked by others through {LOCK_TRIES} tries of "
                             f"{LOCK_MS} ms: run it again when no long transaction holds them")

    def _batch(self, report: MigrationReport, statement, params: dict) -> tuple[list[dict[str, Any]], int]:
        """One backfill statement in a transaction of its own that waits at most BATCH_LOCK_MS for a lock:
        its rows and its row count. Every batch is idempotent, so one that gave way runs again."""
        for attempt in range(BATCH_TRIES):
            try:
                with self._pool.get().connection() as conn, conn.transaction():
                    conn.execute(SQL.lock_timeout, {"lock_ms": BATCH_LOCK_MS})
                    cursor = conn.cursor(row_factory=dict_row).execute(statement, params)
                    return (cursor.fetchall() if cursor.description else []), cursor.rowcount
            except GAVE_WAY:
                report.gave_way += 1
                time.sleep(min(1.0, 0.02 * (attempt + 1)))
        raise MigrationError(f"a backfill batch gave way to the ledger's writers {BATCH_TRIES} times "
                             f"(a transaction held its rows): run it again, it resumes where it stood")

    def _backfill_events(self, report: MigrationReport) -> None:
        after = ""
        while True:
            [row], _ = self._batch(report, SQL.partition_backfill_events, {"after": after, "batch": self._batch_size})
            if not row["read"]:
                return
            report.events += row["read"]
            after = row["last"]
            self._progress("events", report.events)

    def _backfill_deliveries(self, report: MigrationReport, since) -> None:
        self._all(SQL.partition_backfill_deliveries_reset, {"since": since})
        blocks = self._all(SQL.partition_backfill_deliveries_blocks)[0]["blocks"]
        for first in range(0, blocks + 1, SLICE_BLOCKS):
            _, copied = self._batch(report, SQL.partition_backfill_deliveries, {
                "first_block": first, "end_block": first + SLICE_BLOCKS, "since": since})
            report.deliveries += copied
            self._progress("deliveries", report.deliveries)

    def _backfill_attempts(self, report: MigrationReport) -> None:
        after_event, after_attempt = "", 0
        while True:
            [row], _ = self._batch(report, SQL.partition_backfill_attempts, {
                "after_event": after_event, "after_attempt": after_attempt, "batch": self._batch_size})
            if not row["read"]:
                return
            report.attempts += row["read"]
            after_event, after_attempt = row["last_event"], row["last_attempt"]
            self._progress("attempts", report.attempts)

    def _backfill_dependents(self, report: MigrationReport) -> None:
        for table in self._all(SQL.partition_dependents_guard):
            try:
                # Adding the CHECK stops the table's writers while it waits: at most LOCK_MS.
                self._with_lock(report, lambda: self._ddl(table["ddl"]))
            except errors.DuplicateObject:
                pass  # a migration run before this one added it
            statement = pgsql.SQL(SQL.partition_dependents_backfill).format(
                table=pgsql.Identifier("ledger", table["name"]))
            while True:
                _, updated = self._batch(report, statement, {"batch": self._batch_size})
                report.dependents += updated
                if not updated:
                    break
            self._with_lock(report, lambda: self._ddl(table["validate"]))

    def _ddl(self, statement: str) -> None:
        with self._pool.get().connection() as conn, conn.transaction():
            conn.execute(SQL.lock_timeout, {"lock_ms": LOCK_MS})
            conn.execute(statement)

    def _verify(self) -> None:
        """Every table and its twin hold as many rows, seen in one snapshot: a write and its mirror commit
        together, so from the end of the backfill on they are equal in any snapshot, without a lock."""
        with self._pool.get().connection() as conn:
            conn.isolation_level = IsolationLevel.REPEATABLE_READ
            try:
                with conn.transaction():
                    found = conn.cursor(row_factory=dict_row).execute(SQL.partition_migration_counts).fetchone()
            finally:
                conn.isolation_level = None
        for table in ("events", "attempts", "deliveries"):
            if found[table] != found[f"{table}_twin"]:
                raise MigrationError(f"ledger.{table} has {found[table]} rows and its partitioned copy "
                                     f"{found[table + '_twin']}: nothing was swapped (abort, then run it again)")

    def _cleanup(self) -> None:
        with self._pool.get().connection() as conn, conn.transaction():
            conn.execute(SQL.lock_timeout, {"lock_ms": LOCK_MS})
            tables = [pgsql.Identifier("ledger", name) for name, in conn.execute(SQL.partition_migration_set_aside)]
            if tables:
                conn.execute(pgsql.SQL(SQL.lock_exclusive).format(
                    tables=pgsql.SQL(", ").join(tables)))
            conn.execute(SQL.partition_migration_cleanup)

    def _swap(self, report: MigrationReport) -> None:
        started = time.monotonic()
        with self._pool.get().connection() as conn, conn.transaction():
            conn.execute(SQL.lock_timeout, {"lock_ms": LOCK_MS})
            dependents = [pgsql.SQL(", ") + pgsql.Identifier("ledger", name)
                          for name, in conn.execute(SQL.event_dependent_tables)]
            conn.execute(pgsql.SQL(SQL.partition_migration_lock).format(dependents=pgsql.Composed(dependents)))
            conn.execute(SQL.partition_migration_swap)
        report.swap_s = time.monotonic() - started
