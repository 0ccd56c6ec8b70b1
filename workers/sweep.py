"""The recovery sweep: re-drives wake-ups that did not arrive.

Risk it handles: the broker is not durable (Redis restarts empty, an enqueue
fails after the receiver committed, a worker dies holding a message, a retry's
delay is longer than any safe countdown). Postgres knows every event that could
run now; the sweep sends a wake-up for those whose last one is overdue.

It does not flood: only overdue wake-ups, each re-drive doubling the wait before
the next for that event, at most ``batch`` per pass, and no pass while the broker
queue already holds a batch or more (workers are behind; the wake-ups are there).
Several sweepers may run at once: rows are picked with SKIP LOCKED.

Before re-driving, each pass takes over the leases of workers that are gone
(workers/rescue.py); ``run_forever`` runs that rescue on a thread of its own,
every LEDGER_RESCUE_INTERVAL_S, apart from the slower passes.

With LEDGER_CATCHUP_INTERVAL_S set (0, the default, is off), ``run_forever`` also
runs the periodic catch-up (workers/catchup.py) on a thread beside the passes:
the events Stripe has that no webhook delivered, for the platform and every
account with a cursor. Several sweepers may run it: one catch-up per account
runs at a time, the others skip it.

With LEDGER_ARCHIVE_URL set, ``run_forever`` also runs retention (ledger/retention.py) on a
thread of its own every LEDGER_RETENTION_INTERVAL_S (0: never; ``ledgerctl retention run``
still does): final events past their window archived, then removed. Several sweepers may
run it: one run at a time holds the lock, the others skip theirs. On the same thread, before
each run (or, with no run to make, at least hourly), the ledger's monthly partitions are made
ahead of time (ledger/partitions.py).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from celery import Celery

from ledger.config import Settings
from ledger.outbox import OutboxLedger
from ledger.attempts import WorkerLedger
from ledger.partitions import Partitions
from ledger.retention import Retention
from workers import metrics
from workers.rescue import Rescuer
from workers.wakeup import Waker

log = logging.getLogger(__name__)

# With no retention run scheduled, partitions are looked after at least this often (with one, before each run).
PARTITIONS_INTERVAL_S = 3600.0


def queue_depth(celery: Celery, queue: str) -> int | None:
    """Messages waiting in the broker queue; None when the broker does not answer.

    Declares the queue (idempotent) rather than only asking: a broker that came
    back empty (Redis restarted or flushed) gets its queue and bindings again.
    """
    try:
        with celery.connection_for_write() as conn:
            declared = celery.amqp.queues[queue].bind(conn.default_channel).queue_declare()
            return declared.message_count
    except Exception:
        return None


@dataclass(frozen=True)
class SweepResult:
    redriven: int
    queue_depth: int | None
    skipped_backlog: bool
    effects_redriven: int = 0


@dataclass
class Sweeper:
    ledger: WorkerLedger
    waker: Waker
    celery: Celery
    settings: Settings
    # Unsent effects are re-driven the same way (the outbox's backstop).
    outbox: OutboxLedger | None = None
    # Takes over the leases of gone workers (workers/rescue.py): once per pass of run_once, and every
    # LEDGER_RESCUE_INTERVAL_S on a thread of its own in run_forever.
    rescuer: Rescuer | None = None
    # Archives, then removes, final events past their window (only with LEDGER_ARCHIVE_URL set).
    retention: Retention | None = None
    # Makes the ledger's monthly partitions ahead of time (ledger/partitions.py).
    partitions: Partitions | None = None

    def run_once(self, *, rescue: bool = True) -> SweepResult:
        if rescue and self.rescuer is not None:
            self.rescuer.run_once()
        # Broker unreachable (None): wake-ups will fail anyway; the ledger keeps the work.
        depth = queue_depth(self.celery, self.settings.queue_name)
        if depth is not None and depth >= self.settings.sweep_batch:
            return SweepResult(0, depth, skipped_backlog=True)
        ids = self.ledger.take_overdue_wakeups(overdue_s=self.settings.sweep_overdue_s,
                                               batch=self.settings.sweep_batch)
        sent = sum(self.waker.wake(event_id) for event_id in ids)
        effect_ids = [] if self.outbox is None else self.outbox.take_overdue_wakeups(
            overdue_s=self.settings.sweep_overdue_s, batch=max(0, self.settings.sweep_batch - len(ids)))
        sent_effects = sum(self.waker.wake_effect(outbox_id) for outbox_id in effect_ids)
        if ids or effect_ids:
            metrics.REDRIVES.inc(sent + sent_effects)
            log.info("sweep re-drove overdue wake-ups", extra={"redriven": sent, "picked": len(ids),
                                                             "effects_redriven": sent_effects,
                                                             "queue_depth": depth})
        return SweepResult(sent, depth, skipped_backlog=False, effects_redriven=sent_effects)

    def run_forever(self, *, stop_after: float | None = None) -> None:
        started = time.monotonic()
        stop = threading.Event()
        catchup = self._start_catchup(stop)
        retention = self._start_retention(stop)
        rescue = None
        if self.rescuer is not None:
            rescue = threading.Thread(target=self.rescuer.run_until, args=(stop, self.settings.rescue_interval_s),
                                      name="rescue", daemon=True)
            rescue.start()
        try:
            while stop_after is None or time.monotonic() - started < stop_after:
                try:
                    result = self.run_once(rescue=False)
                except Exception as exc:
                    log.error("sweep pass failed; next pass will try again",
                              extra={"error_class": type(exc).__name__})
                    result = None
                # A full batch means more may be waiting: go again without sleeping.
                if result is None or result.redriven + result.effects_redriven < self.settings.sweep_batch:
                    time.sleep(self.settings.sweep_interval_s)
        finally:
            stop.set()
            for thread in (catchup, retention, rescue):
                if thread is not None:
                    thread.join()

    def _start_catchup(self, stop: threading.Event) -> threading.Thread | None:
        interval = self.settings.catchup_interval_s
        if not interval:
            return None
        from workers.catchup import PeriodicCatchup  # only a sweep that runs it needs Stripe's client

        periodic = PeriodicCatchup(self.settings, self.waker, interval_s=interval)

        def run():
            try:
                periodic.run_until(stop)
            finally:
                periodic.close()
        thread = threading.Thread(target=run, name="catchup", daemon=True)
        thread.start()
        log.info("periodic catch-up on", extra={"interval_s": interval})
        return thread

    def _start_retention(self, stop: threading.Event) -> threading.Thread | None:
        """Upkeep on the retention schedule: the partitions ahead of time (always, every hour at least), then
        the retention run (with an archive set and a non-zero interval)."""
        interval = self.settings.retention_interval_s
        retention = self.retention if self.retention is not None and self.retention.store is not None and interval \
            else None
        if retention is None and self.partitions is None:
            return None
        partitions = self.partitions

        def run():
            while not stop.is_set():
                if partitions is not None:
                    self._ensure_partitions(partitions)
                if retention is None:
                    stop.wait(min(interval or PARTITIONS_INTERVAL_S, PARTITIONS_INTERVAL_S))
                    continue
                try:
                    report = retention.run()
                except Exception as exc:  # the run records its own failures; this is Postgres being away
                    log.error("retention run could not start; the next one will try again",
                              extra={"error_class": type(exc).__name__})
                else:
                    metrics.RETENTION_RUNS.labels(report.status).inc()
                    if report.status != "skipped":
                        metrics.RETENTION_EVENTS.labels("archived").inc(report.archived)
                        metrics.RETENTION_EVENTS.labels("removed").inc(report.removed)
                        metrics.RETENTION_MONTHS.labels("replaced").inc(report.partitions_dropped)
                        metrics.RETENTION_MONTHS.labels("deferred").inc(report.months_deferred)
                        log.info("retention run", extra={"run_id": report.run_id, "status": report.status,
                                                         "archived": report.archived, "removed": report.removed,
                                                         "changed": report.changed,
                                                         "kept_by_hold": report.kept_by_hold,
                                                         "months_replaced": report.partitions_dropped,
                                                         "months_deferred": report.months_deferred,
                                                         "seconds": round(report.seconds, 3)})
                stop.wait(interval)
        thread = threading.Thread(target=run, name="retention", daemon=True)
        thread.start()
        if retention is not None:
            log.info("retention on", extra={"interval_s": interval, "archive": retention.store.url})
        return thread

    @staticmethod
    def _ensure_partitions(partitions: Partitions) -> None:
        try:
            made = partitions.ensure()
        except Exception as exc:  # a lock not granted within its second, Postgres away: the next pass makes them
            metrics.PARTITION_PASSES.labels("failed").inc()
            log.warning("partitions not made this pass; the next one will try again",
                        extra={"error_class": type(exc).__name__})
            return
        metrics.PARTITION_PASSES.labels("done").inc()
        if made:
            log.info("partitions made ahead of time", extra={"partitions": made})
