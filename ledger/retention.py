"""Retention: final events past their window leave the ledger, archived first (docs/retention.md).

A run, one at a time across hosts (a session-level advisory lock: a second runner skips):

1. **archives** every event past its window (processed: LEDGER_RETAIN_PROCESSED_DAYS after
   processing; failed_permanent: LEDGER_RETAIN_FAILED_DAYS after the failure), one line per
   event with every row that names it, into one file per month of Stripe's ``created``;
   never an unfinished event, one with an effect still to deliver, or a held one. It reads
   the table once, in slices of heap blocks (SLICE_BLOCKS per task), so no statement sorts,
   none holds a snapshot for long, and no index is added to the receiver's inserts; the lines
   are built outside Postgres, in niced processes held to the run's budget
   (ledger/archive_builders.py);
2. **puts** each file, then its manifest, in the store;
3. **reads it back** and checks it against what was written (size, SHA-256, events);
4. records it in ``ledger.archive_files``; only then
5. **removes** the events it holds, a page per transaction, each only if its rows are still
   the ones its line was built from (its version, ledger/archive_lines.py: a delivery or a
   replay since leaves it for the next run). On a partitioned ledger a month past the window
   leaves as tables instead: what it keeps is staged into new ones, swapped in under a short
   lock, and the old ones dropped (a month whose tables stay locked waits for the next run).

A run that dies anywhere repeats safely: before 5 nothing left the ledger, and a file
without its manifest counts for nothing; during 5, the events not yet removed are
archived again by the next run (a restore of both files writes each event once), which
also finishes a month's swap that committed, or drops the staged tables of one that did not.
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from psycopg import errors, sql as pgsql

from ledger.archive import (ArchiveStore, ArchiveWriter, Manifest, MANIFEST_SUFFIX, fetch_verified, file_key,
                            read_lines, sha256_of)
from ledger.archive_builders import Builders, Pace, Slice, yielding
from ledger.archive_lines import versions
from ledger.db import ProcessPool, session_lock
from ledger.config import RetentionBudget, RetentionPolicy
from ledger.errors import ConfigError
from ledger.queries import SQL
from ledger.statements import run_statement

log = logging.getLogger(__name__)

# Events removed per transaction (its row locks' hold), and heap blocks (8 KB) read per builder's task.
REMOVE_PAGE = 500
REMOVE_PAGE_MIN = 25
REMOVE_TARGET_S = 0.2
SLICE_BLOCKS = 1024
# A month's swap takes the ledger tables' exclusive lock (its watch, the month's partitions'): waited for
# at most this long (a receiver's insert queues behind the waiting swap meanwhile), then tried again,
# DROP_TRIES times a run.
DROP_LOCK_MS = 200
DROP_TRIES = 3


@dataclass
class RunReport:
    run_id: int | None
    status: str              # done | failed | skipped (another runner holds the lock)
    archived: int = 0
    removed: int = 0
    changed: int = 0
    kept_by_hold: int = 0
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    # Where the time went: reading the events' lines out of Postgres and compressing them, writing
    # and reading back the files, removing; and the longest removal transaction (its row locks' hold).
    read_s: float = 0.0
    build_cpu_s: float = 0.0     # the builder processes' CPU (ledger/archive_builders.py)
    store_s: float = 0.0
    remove_s: float = 0.0
    longest_removal_s: float = 0.0
    # Months past the window whose partitions left as tables (a partitioned ledger), the events they
    # kept (in their month's new partitions), the longest swap (the tables' lock hold), and the months
    # that stayed because the tables stayed locked (the next run tries again).
    partitions_dropped: int = 0
    kept_in_month: int = 0
    longest_drop_s: float = 0.0
    months_deferred: int = 0


class Retention:
    """The retention runner, holds, and restores, over one database and one archive store."""

    def __init__(self, pool: ProcessPool, store: ArchiveStore | None, policy: RetentionPolicy,
                 *, budget: RetentionBudget = RetentionBudget(), runner: str | None = None, page: int = REMOVE_PAGE,
                 slice_blocks: int = SLICE_BLOCKS, before_removal: Callable[[Manifest], None] | None = None):
        self._pool = pool
        self.store = store
        self.policy = policy
        self.budget = budget
        self.runner = runner or f"{socket.gethostname()}:{os.getpid()}"
        self._page = page
        self._slice_blocks = slice_blocks
        # A test's hook between a verified archive and its removal (the crash the docs promise survives).
        self._before_removal = before_removal

    def _all(self, sql: str, params: dict | None = None) -> list[dict[str, Any]]:
        return run_statement(self._pool, sql, params)

    def _store(self) -> ArchiveStore:
        if self.store is None:
            raise ConfigError("LEDGER_ARCHIVE_URL is not set: nothing leaves the ledger without an archive")
        return self.store

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> RunReport:
        """One retention run; ``skipped`` while another holds the lock."""
        self._store()
        started = time.monotonic()
        # Held across the run's many short transactions, on a session of its own (ledger.db.session_lock).
        with session_lock(self._pool.settings, SQL.retention_try_lock, SQL.retention_unlock,
                          name="ledger-retention") as held:
            if not held:
                return RunReport(None, "skipped")
            run_id = self._all(SQL.retention_run_start, {"runner": self.runner, **self.policy.params()})[0]["id"]
            report = RunReport(run_id, "running")
            try:
                with yielding(self.budget.nice):
                    self._archive_and_remove(report)
                report.kept_by_hold = self._all(SQL.retention_count_held, self.policy.params())[0]["held"]
                report.status = "done"
            except Exception as exc:
                report.status, report.error = "failed", f"{type(exc).__name__}: {exc}"
                log.error("retention run failed; nothing unarchived was removed",
                          extra={"run_id": run_id, "error_class": type(exc).__name__})
            finally:
                report.seconds = time.monotonic() - started
                self._all(SQL.retention_run_finish, {"run_id": run_id, "status": report.status,
                                                     "error": report.error, "kept_by_hold": report.kept_by_hold,
                                                     "partitions_dropped": report.partitions_dropped})
            return report

    def _archive_and_remove(self, report: RunReport) -> None:
        self._finish_leftovers()
        watched = self._watch_months(report)
        with tempfile.TemporaryDirectory(prefix="ledger-retention-") as tmp:
            writers = self._archive(report, Path(tmp))
            for month in sorted(writers):
                self._store_and_remove(report, month, writers[month], Path(tmp), replace=month in watched)

    # -- a month past the window: replaced by what it keeps (migration 0014) --------------------

    def _locked(self, step: Callable[[Any], Any]) -> Any:
        """``step(conn)`` in a transaction that waits at most DROP_LOCK_MS for a lock, tried DROP_TRIES times;
        None when every try gave way (to a transaction holding the tables, or a deadlock Postgres broke on
        it): the next run tries again."""
        for attempt in range(DROP_TRIES):
            try:
                with self._pool.get().connection() as conn, conn.transaction():
                    conn.execute(SQL.lock_timeout, {"lock_ms": DROP_LOCK_MS})
                    return step(conn)
            except (errors.LockNotAvailable, errors.DeadlockDetected):
                time.sleep(DROP_LOCK_MS / 1000 * (attempt + 1))
        return None

    def _watch_months(self, report: RunReport) -> set[str]:
        """The months past the processed window ('YYYY-MM'), each watched before the run reads it (every
        change to one of its events from now on is logged); a month whose partitions stayed locked is
        removed row by row this run instead."""
        watched = set()
        for row in self._all(SQL.partitions_past_window, self.policy.params()):
            done = self._locked(lambda conn: conn.execute(SQL.partition_month_watch, {"month": row["month"]})
                                .fetchone()[0])
            if done:
                watched.add(f"{row['month']:%Y-%m}")
            elif done is None:
                report.months_deferred += 1
        return watched

    def _replace_month(self, report: RunReport, key: str, month: str, ids: Iterator[str]) -> None:
        """A verified month leaves as tables: its kept events staged into new ones, swapped in under a
        short lock, the old ones dropped, then the plain tables' rows of the events that left."""
        first = date.fromisoformat(f"{month}-01")
        params = {"run_id": report.run_id, "month": first}
        with self._pool.get().connection() as conn, conn.transaction():
            conn.execute(SQL.retention_archived_clear, params)
            with conn.cursor().copy(SQL.retention_archived_copy) as copy:
                for event_id in ids:
                    copy.write_row((report.run_id, first, event_id))
        self._all(SQL.partition_month_stage, params)
        started = time.monotonic()
        swapped = self._locked(lambda conn: conn.execute(SQL.partition_month_swap, params).fetchone())
        if swapped is None:
            # Its events stay (archived: the next run archives them again, a restore writes each once).
            self._all(SQL.partition_month_unstage, params)
            self._all(SQL.retention_archived_clear, params)
            report.months_deferred += 1
            log.warning("a month past the window stayed: the ledger's tables stayed locked",
                        extra={"run_id": report.run_id, "month": month})
            return
        kept, changed, archived_kept = swapped
        report.longest_drop_s = max(report.longest_drop_s, time.monotonic() - started)
        report.partitions_dropped += 1
        report.kept_in_month += kept
        left = self._archived_count(report.run_id, first) - archived_kept
        report.removed += left
        report.changed += archived_kept
        self._all(SQL.archive_file_removed, {"key": key, "removed": left})
        self._progress(report.run_id, removed=left, changed=archived_kept)
        self._finish_swapped(report.run_id, first)
        log.info("month replaced by what it keeps", extra={"run_id": report.run_id, "month": month,
                                                           "kept_events": kept, "changed": changed})

    def _archived_count(self, run_id: int, month: date) -> int:
        return self._all(SQL.retention_archived_count, {"run_id": run_id, "month": month})[0]["archived"]

    def _finish_swapped(self, run_id: int, month: date) -> None:
        """After a month's swap: its detached tables dropped (or by the next run, if they stayed locked), the
        plain tables' rows of its gone events deleted, its archived ids cleared."""
        params = {"run_id": run_id, "month": month}
        self._drop_gone(month)
        for row in self._all(SQL.event_dependent_tables):
            self._all(pgsql.SQL(SQL.retention_dependents_gone).format(table=pgsql.Identifier("ledger", row["name"])),
                      params)
        self._all(SQL.retention_archived_clear, params)

    def _drop_gone(self, month: date) -> None:
        def drop(conn) -> bool:
            gone = [pgsql.Identifier("ledger", name)
                    for name, in conn.execute(SQL.partition_month_gone, {"month": month})]
            if gone:
                conn.execute(pgsql.SQL(SQL.lock_exclusive).format(tables=pgsql.SQL(", ").join(gone)))
                conn.execute(SQL.partition_month_drop_gone, {"month": month})
            return True
        self._locked(drop)

    def _finish_leftovers(self) -> None:
        """What a run that died left of a month's replacement: a swap that committed is finished, staged
        tables of one that did not are dropped (the month is archived and replaced again)."""
        for row in self._all(SQL.retention_archived_pending):
            if row["swapped"]:
                self._finish_swapped(row["run_id"], row["month"])
            else:
                self._all(SQL.retention_archived_clear, row)
        for row in self._all(SQL.partition_month_leftovers):
            if row["kind"] == "kept":
                self._all(SQL.partition_month_unstage, row)
            else:
                self._drop_gone(row["month"])

    def _archive(self, report: RunReport, tmp: Path) -> dict[str, ArchiveWriter]:
        """Every event past its window into its month's file: the table read once, a slice of blocks
        per builder's task, appended in the tables' order."""
        started = time.monotonic()
        writers: dict[str, ArchiveWriter] = {}
        try:
            pieces = [Slice(heap["relation"], first, first + self._slice_blocks,
                            {"created_from": heap["created_from"], "created_to": heap["created_to"]})
                      for heap in self._all(SQL.events_heap_blocks)
                      for first in range(0, heap["blocks"], self._slice_blocks)]
            with Builders(self._pool.settings, self.budget) as builders:
                for chunks in builders.chunks(pieces, self.policy.params()):
                    for month, chunk in chunks.items():
                        writer = writers.get(month)
                        if writer is None:
                            writer = writers[month] = ArchiveWriter(tmp, month)
                        writer.append(chunk)
            report.build_cpu_s = builders.cpu_s
        finally:
            for writer in writers.values():
                writer.close()
            report.read_s += time.monotonic() - started
        return writers

    def _store_and_remove(self, report: RunReport, month: str, writer: ArchiveWriter, tmp: Path, *,
                          replace: bool = False) -> None:
        key = file_key(date.fromisoformat(f"{month}-01"), report.run_id)
        started = time.monotonic()
        sha256, size = sha256_of(writer.path), writer.path.stat().st_size
        manifest = Manifest(key=key, month=month, run_id=report.run_id, events=writer.events, bytes=size,
                            sha256=sha256, first_event=writer.first_event, last_event=writer.last_event)
        manifest_path = tmp / f"{month}.manifest.json"
        manifest_path.write_bytes(manifest.to_json())
        self.store.put(key, writer.path)
        self.store.put(key + MANIFEST_SUFFIX, manifest_path)
        fetch_verified(self.store, manifest, tmp / f"{month}.read-back.jsonl.gz")
        report.store_s += time.monotonic() - started
        self._all(SQL.archive_file_record, {"key": key, "run_id": report.run_id, "month": f"{month}-01",
                                            "events": manifest.events, "bytes": size, "sha256": sha256})
        report.files.append(key)
        report.archived += manifest.events
        self._progress(report.run_id, archived=manifest.events, files=1)
        if self._before_removal is not None:
            self._before_removal(manifest)
        if replace:
            self._replace_month(report, key, month, (event_id for event_id, _ in writer.versions()))
        else:
            self._remove(report, key, writer.versions(), self._month_bounds(month))

    def _month_bounds(self, month: str) -> dict[str, datetime | None]:
        """A file's month as the bounds of its events' `created`, on a partitioned ledger (where every row
        naming an event has it, and a statement given them reads that month's partitions only); none on a
        plain one (rows recorded before migration 0012 have no event_created)."""
        if not self._all(SQL.ledger_is_partitioned)[0]["partitioned"]:
            return {"created_from": None, "created_to": None}
        first = datetime.strptime(month, "%Y-%m").replace(tzinfo=timezone.utc)
        following = first.replace(year=first.year + first.month // 12, month=first.month % 12 + 1)
        return {"created_from": first, "created_to": following}

    def _remove(self, report: RunReport, key: str, archived: Iterator[tuple[str, str]],
                bounds: dict[str, datetime | None]) -> None:
        # The page follows the time a removal takes, so its row locks (which a redelivery of one of these
        # events would wait on) are held about REMOVE_TARGET_S: halved after a slow one, grown after quick ones.
        # Pages go no faster than the run's budget: deletes are the server's CPU and WAL, beside the receiver's.
        size = self._page
        pace = Pace(self.budget.max_rate)
        while page := list(itertools.islice(archived, size)):
            started = time.monotonic()
            removed = self._remove_page(dict(page), bounds)
            took = time.monotonic() - started
            if took > 2 * REMOVE_TARGET_S:
                size = max(REMOVE_PAGE_MIN, size // 2)
            elif took < REMOVE_TARGET_S / 2:
                size = min(self._page * 4, size * 2)
            report.remove_s += took
            report.longest_removal_s = max(report.longest_removal_s, took)
            self._all(SQL.archive_file_removed, {"key": key, "removed": removed})
            report.removed += removed
            report.changed += len(page) - removed
            self._progress(report.run_id, removed=removed, changed=len(page) - removed)
            pace.done(len(page))

    def _remove_page(self, archived: dict[str, str], bounds: dict[str, datetime | None]) -> int:
        """One transaction: lock the page's events, then delete those whose rows are still the ones their
        line was built from (events_lock_archived says why the lock comes first)."""
        ids = list(archived)
        with self._pool.get().connection() as conn, conn.transaction():
            conn.execute(SQL.events_lock_archived, {"ids": ids})
            now = versions(conn, ids, bounds)
            unchanged = [event_id for event_id in ids if now.get(event_id) == archived[event_id]]
            if not unchanged:
                return 0
            return len(conn.execute(SQL.events_remove_archived, {"ids": unchanged, **bounds}).fetchall())

    def _progress(self, run_id: int, *, archived: int = 0, removed: int = 0, changed: int = 0,
                  files: int = 0) -> None:
        self._all(SQL.retention_run_progress, {"run_id": run_id, "archived": archived, "removed": removed,
                                               "changed": changed, "files": files})

    # -- what an operator reads ---------------------------------------------------------------

    def recent_runs(self, limit: int = 10) -> list[dict[str, Any]]:
        return self._all(SQL.retention_runs_recent, {"limit": limit})

    def health(self) -> dict[str, Any]:
        """For the metrics: when the latest completed run ended (unix time, None: never), and whether the
        latest run failed."""
        return self._all(SQL.retention_health)[0]

    def catalogued_files(self) -> list[dict[str, Any]]:
        return self._all(SQL.archive_files_list)

    # -- holds --------------------------------------------------------------------------------

    def hold(self, *, event_id: str | None = None, customer_id: str | None = None, reason: str,
             actor: str) -> int:
        return self._all(SQL.retention_hold_add, {"event_id": event_id, "customer_id": customer_id,
                                                  "reason": reason, "actor": actor})[0]["id"]

    def release(self, hold_id: int, *, actor: str) -> bool:
        return bool(self._all(SQL.retention_hold_release, {"id": hold_id, "actor": actor}))

    def holds(self) -> list[dict[str, Any]]:
        return self._all(SQL.retention_holds_active)

    # -- restore ------------------------------------------------------------------------------

    def restore(self, key: str, *, batch: int = 500) -> tuple[int, int]:
        """An archived file back into the ledger, after checking it against its manifest: (written,
        already there). Each batch of lines is one statement, so one transaction."""
        store = self._store()
        manifest = store.manifest(key)
        written = present = 0
        with tempfile.TemporaryDirectory(prefix="ledger-restore-") as tmp:
            path = Path(tmp) / "restore.jsonl.gz"
            fetch_verified(store, manifest, path)
            lines = read_lines(path)
            while chunk := list(itertools.islice(lines, batch)):
                done = self._all(SQL.events_restore_lines, {"lines": chunk})[0]["written"]
                written, present = written + done, present + len(chunk) - done
        self._all(SQL.archive_file_restored, {"key": key})
        return written, present

    def verify(self, key: str) -> Manifest:
        """Read a file back and check it against its manifest; ArchiveError if it differs."""
        store = self._store()
        manifest = store.manifest(key)
        with tempfile.TemporaryDirectory(prefix="ledger-verify-") as tmp:
            fetch_verified(store, manifest, Path(tmp) / "verify.jsonl.gz")
        return manifest
