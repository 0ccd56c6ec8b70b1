"""The worker's Celery app: ``celery -A workers worker`` finds ``app`` here."""
from __future__ import annotations

from ledger.config import Settings
from ledger.errors import ConfigError
from ledger.logs import configure as configure_logging
from workers.app import make_celery

configure_logging()
try:
    settings = Settings.from_env()
except ConfigError as exc:
    raise SystemExit(f"configuration error: {exc}") from None

app = make_celery(settings)
app.conf.imports = ("workers.tasks",)
