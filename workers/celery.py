"""The worker's Celery app: ``celery -A workers worker`` finds ``app`` here."""
from __future__ import annotations

import os

from celery.signals import worker_init, worker_process_shutdown

from ledger.config import Settings
from ledger.errors import ConfigError
from ledger.logs import configure as configure_logging
from workers.app import make_celery
from workers.runtime import Runtime
from workers.tasks import register_tasks

configure_logging()
try:
    settings = Settings.from_env()
except ConfigError as exc:
    raise SystemExit(f"configuration error: {exc}") from None

app = make_celery(settings)
register_tasks(app, Runtime(settings, app))


@worker_init.connect
def _serve_metrics(**_):
    # In the pool's parent, once: children write to PROMETHEUS_MULTIPROC_DIR, the parent serves the sum.
    if settings.metrics_port:
        from workers.metrics import serve

        serve(settings.metrics_port)


@worker_process_shutdown.connect
def _forget_dead_child(pid=None, **_):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and pid:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
