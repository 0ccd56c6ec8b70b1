"""Per-process wiring for workers and the sweep, built on first use (after fork)."""
from __future__ import annotations

from functools import cached_property

from celery import Celery

from ledger.archive import open_store
from ledger.config import Settings
from ledger.db import ProcessPool
from ledger.liveness import Liveness
from ledger.outbox import OutboxLedger
from ledger.attempts import WorkerLedger
from ledger.partitions import Partitions
from ledger.retention import Retention
from workers.dispatcher import OutboxDispatcher
from workers.effects import Sender, load_senders
from workers.processor import EventProcessor
from workers.registry import load_handlers
from workers.rescue import Rescuer
from workers.retry import RetryPolicy
from workers.sweep import Sweeper
from workers.wakeup import Waker


class Runtime:
    def __init__(self, settings: Settings, celery: Celery):
        self.settings = settings
        self.celery = celery

    @cached_property
    def pool(self) -> ProcessPool:
        return ProcessPool(self.settings, name="worker", guarded=True)

    @cached_property
    def liveness(self) -> Liveness:
        return Liveness(self.settings)

    @cached_property
    def ledger(self) -> WorkerLedger:
        return WorkerLedger(self.pool, liveness=self.liveness)

    @cached_property
    def outbox(self) -> OutboxLedger:
        return OutboxLedger(self.pool, liveness=self.liveness)

    @cached_property
    def senders(self) -> dict[str, Sender]:
        return load_senders(self.settings)

    @cached_property
    def waker(self) -> Waker:
        return Waker(self.celery)

    @cached_property
    def processor(self) -> EventProcessor:
        registry = load_handlers(self.settings)
        return EventProcessor.from_settings(self.settings, self.ledger, registry, self.waker,
                                            enabled_effects=frozenset(self.senders))

    @cached_property
    def dispatcher(self) -> OutboxDispatcher:
        return OutboxDispatcher(ledger=self.outbox, senders=self.senders,
                                policy=RetryPolicy.from_settings(self.settings), waker=self.waker,
                                lease_s=self.settings.lease_s)

    @cached_property
    def rescuer(self) -> Rescuer:
        return Rescuer(self.ledger, self.waker, outbox=self.outbox)

    @cached_property
    def retention(self) -> Retention:
        """Retention on this process's pool; without LEDGER_ARCHIVE_URL it has no store and never runs."""
        url = self.settings.archive_url
        return Retention(self.pool, open_store(url) if url else None,
                         self.settings.retention_policy(), budget=self.settings.retention_budget())

    @cached_property
    def partitions(self) -> Partitions:
        return Partitions(self.pool)

    @cached_property
    def sweeper(self) -> Sweeper:
        return Sweeper(self.ledger, self.waker, self.celery, self.settings, outbox=self.outbox, rescuer=self.rescuer,
                       retention=self.retention, partitions=self.partitions)


def sweep_process(settings: Settings, *, operator=None, outbox: OutboxLedger | None = None) -> Sweeper:
    """The sweep's process (``ledgerctl sweep``): JSON logs, its own Celery app and runtime, and, for a
    process that runs for good (``operator`` given) with METRICS_PORT set, the Prometheus endpoint with the
    ledger-wide gauges: the sweep is their natural home, one per deployment, always running."""
    from ledger.logs import configure as configure_logging
    from workers.app import make_celery

    configure_logging()
    runtime = Runtime(settings, make_celery(settings))
    if operator is not None and settings.metrics_port:
        from ledger.reconcile_runs import ReconcileRuns
        from workers.app import effects_queue
        from workers.metrics import serve
        from workers.sweep import queue_depth

        queues = (settings.queue_name, effects_queue(settings.queue_name))
        serve(settings.metrics_port, operator=operator, outbox=outbox or runtime.outbox,
              reconcile=ReconcileRuns(runtime.pool), retention=runtime.retention, partitions=runtime.partitions,
              queue_depths=lambda: {queue: queue_depth(runtime.celery, queue) for queue in queues})
    return runtime.sweeper
