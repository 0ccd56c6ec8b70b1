"""Receiver metrics (prometheus-client).

Under gunicorn with several workers set PROMETHEUS_MULTIPROC_DIR so /metrics
aggregates every worker process.
"""
from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import multiprocess

REQUESTS = Counter("ingest_requests_total", "Webhook deliveries by outcome", ["outcome"])
DUPLICATES = Counter("ingest_duplicates_total", "Deliveries of an event id already in the ledger", ["status"])
WAKEUPS_LOST = Counter("ingest_wakeups_failed_total", "Recorded events whose wake-up the broker did not take")
LATENCY = Histogram("ingest_request_seconds", "Time from request to answer",
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))


def render() -> tuple[bytes, str]:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
