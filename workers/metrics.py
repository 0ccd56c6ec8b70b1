"""Worker and sweep metrics (prometheus-client).

Counters are incremented where things happen (processor, dispatcher, rescuer,
sweep, catch-up, Stripe's API client). Ledger-wide gauges (events by status,
oldest unprocessed age, due retries, expired leases; the outbox, retention,
partitions, reconcile drift) are read from Postgres at scrape time by
``LedgerCollector``: the ledger is the truth, so no process has to keep them in
memory.

``serve(port)`` exposes them over HTTP. Celery's prefork children each count on
their own: set ``PROMETHEUS_MULTIPROC_DIR`` (an empty directory per host) so the
parent's endpoint adds up every child.
"""
from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client import REGISTRY, multiprocess
from prometheus_client.core import GaugeMetricFamily

ATTEMPTS = Counter("worker_attempts_total", "Finished attempts by event type, outcome and reason",
                   ["type", "outcome", "reason"])
ATTEMPT_SECONDS = Histogram("worker_attempt_seconds", "Time from claim to finished attempt", ["type"],
                            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
RETRIES_SCHEDULED = Counter("worker_retries_scheduled_total", "Recoverable failures scheduled for a retry",
                            ["type", "reason"])
# reason: worker_gone (the rescuer found the owner's session ended: workers/rescue.py), lease_expired (a claim
# took over a lease that ran out: the owner was stopped, or claimed without liveness); work: event, effect.
WORKER_RESCUES = Counter("worker_rescues_total", "Leases taken over from workers that were gone or out of time",
                         ["reason", "work"])
RESCUE_DELAY = Histogram("worker_rescue_delay_seconds",
                         "From the last rescue pass that saw a gone worker's session alive to its event's takeover",
                         buckets=(0.25, 0.5, 1, 2, 3, 5, 8, 12, 15, 20, 30, 60, 120))
LOCK_DEFERRALS = Counter("worker_lock_deferrals_total",
                         "Events applied in a second transaction because another held one of their objects")
APPLY_FALLBACKS = Counter("worker_apply_fallbacks_total",
                          "Batches whose set-based apply failed and were applied again one savepoint per event",
                          ["reason"])
REDRIVES = Counter("sweep_redrives_total", "Wake-ups re-sent by the recovery sweep")
OUTBOX_SENT = Counter("outbox_sent_total", "Effects delivered", ["effect"])
OUTBOX_RETRIES = Counter("outbox_retries_total", "Effect deliveries that failed recoverably and were rescheduled",
                         ["effect", "reason"])
OUTBOX_FAILED = Counter("outbox_failed_total", "Effects that ended failed_permanent", ["effect", "reason"])
# Stripe's API (catch-up, backfill, reconcile): every request's outcome, and the retries of the one rule
# (workers/stripe_api.py). Outcomes: ok, rate_limited, server_error, timeout, connection, rejected.
STRIPE_API_REQUESTS = Counter("stripe_api_requests_total", "Stripe API requests by outcome", ["outcome"])
STRIPE_API_RETRIES = Counter("stripe_api_retries_total", "Stripe API requests tried again, by reason", ["reason"])
# Alert on any increase: each is an event Stripe generated that no webhook delivery brought us.
CATCHUP_MISSED = Counter("catchup_missed_events_total",
                         "Events catch-up found that no webhook had delivered, by event type", ["type"])

# Alert on any increase: Stripe failed to generate an event (v2.core.health.event_generation_failure.resolved);
# repair says whether the worker refetched and applied the object (applied) or an operator must look.
HEALTH_ALERTS = Counter("stripe_health_alerts_total",
                        "Stripe event generation failures recorded, by the failed event type and repair",
                        ["failed_type", "repair"])

# Retention runs of this sweep (ledger/retention.py) by outcome (done, failed, skipped: another held the lock),
# and the events they archived and removed. The ledger-wide view is the gauges below, from ledger.retention_runs.
RETENTION_RUNS = Counter("retention_runs_total", "Retention runs started by this process, by outcome", ["status"])
RETENTION_EVENTS = Counter("retention_events_total", "Events retention archived and removed", ["action"])
# Months past the window (a partitioned ledger) that left as tables, and those that stayed because the
# ledger's tables stayed locked through every try of a run (the next run tries again).
RETENTION_MONTHS = Counter("retention_months_total", "Months past the window retention replaced, or had to leave "
                           "for the next run", ["outcome"])
# Partition upkeep passes of this sweep (ledger/partitions.py), by outcome (done, failed).
PARTITION_PASSES = Counter("partition_passes_total", "Partition upkeep passes run by this process", ["outcome"])


class LedgerCollector:
    """Gauges read from ledger.events at scrape time (only the small unfinished set, plus status counts)."""

    def __init__(self, operator, outbox=None, reconcile=None, queue_depths=None, retention=None, partitions=None):
        self._operator = operator
        self._partitions = partitions
        self._outbox = outbox
        self._reconcile = reconcile
        self._retention = retention
        # A callable: {queue name: messages waiting, None when the broker does not answer}, on either broker.
        self._queue_depths = queue_depths

    def collect(self):
        try:
            stats = self._operator.stats()
            outbox = self._outbox.stats() if self._outbox is not None else None
            drift = self._reconcile.drift_by_type() if self._reconcile is not None else None
            kept = self._retention.health() if self._retention is not None and self._retention.store else None
            planned = self._partitions.health() if self._partitions is not None else None
        except Exception:
            return  # Postgres unreachable: no gauges this scrape rather than wrong ones
        if outbox is not None:
            yield GaugeMetricFamily("outbox_depth", "Effects recorded and not yet sent", value=outbox["depth"])
            yield GaugeMetricFamily("outbox_failed_permanent", "Effects waiting for an operator",
                                    value=outbox["failed_permanent"])
            yield GaugeMetricFamily("outbox_oldest_unsent_age_seconds", "Age of the oldest unsent effect",
                                    value=outbox["oldest_unsent_age_s"] or 0.0)
        if self._queue_depths is not None:
            depth = GaugeMetricFamily("broker_queue_depth", "Wake-ups waiting in the broker's queue (Redis or "
                                      "RabbitMQ); absent while the broker does not answer", labels=["queue"])
            for queue, messages in self._queue_depths().items():
                if messages is not None:
                    depth.add_metric([queue], messages)
            yield depth
        by_status = GaugeMetricFamily("ledger_events", "Events in the ledger by status", labels=["status"])
        for status, count in stats["by_status"].items():
            by_status.add_metric([status], count)
        yield by_status
        age = stats["oldest_unprocessed_age_s"]
        yield GaugeMetricFamily("ledger_oldest_unprocessed_age_seconds",
                                "Age of the oldest event not yet processed (0 when none)", value=age or 0.0)
        yield GaugeMetricFamily("ledger_due_retries", "Recoverable failures whose retry is due",
                                value=stats["due_retries"])
        yield GaugeMetricFamily("ledger_expired_leases", "Processing events whose worker's lease expired",
                                value=stats["expired_leases"])
        if kept is not None:
            yield GaugeMetricFamily("retention_last_success_timestamp_seconds",
                                    "When the latest retention run that completed ended (unix time; 0: none yet)",
                                    value=kept["last_success_s"] or 0.0)
            yield GaugeMetricFamily("retention_last_run_failed", "1 while the latest retention run failed",
                                    value=1.0 if kept["last_failed"] else 0.0)
        if planned is not None and planned.partitioned:
            yield GaugeMetricFamily("ledger_partitions_months_ahead",
                                    "Months after the current one whose ledger partitions exist",
                                    value=planned.months_ahead)
            yield GaugeMetricFamily("ledger_partition_strays",
                                    "Events outside every planned partition (in the default one, of a month "
                                    "no retention run dropped)", value=planned.strays)
        if drift is not None:
            objects = GaugeMetricFamily("reconcile_drift_objects",
                                        "Objects that drifted from Stripe in the latest reconcile run of their type",
                                        labels=["type"])
            for row in drift:
                objects.add_metric([row["type"]], row["objects"])
            yield objects
            if drift:
                yield GaugeMetricFamily("reconcile_last_run_timestamp_seconds",
                                        "When the latest reconcile run was recorded (unix time)",
                                        value=max(row["ran_at"] for row in drift).timestamp())


def registry_for_export(operator=None, outbox=None, reconcile=None, queue_depths=None,
                        retention=None, partitions=None) -> CollectorRegistry:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    if operator is not None:
        registry.register(LedgerCollector(operator, outbox, reconcile, queue_depths, retention, partitions))
    return registry


def serve(port: int, operator=None, outbox=None, reconcile=None, queue_depths=None, retention=None,
          partitions=None) -> None:
    """Expose /metrics on ``port`` from a background thread of this process."""
    start_http_server(port, registry=registry_for_export(operator, outbox, reconcile, queue_depths, retention,
                                                                 partitions))
