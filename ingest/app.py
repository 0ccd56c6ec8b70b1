"""Flask app factory for the receiver: ``gunicorn 'ingest.app:create_app()'``."""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from flask import Flask, Response, jsonify
from werkzeug.exceptions import HTTPException

from ingest import metrics
from ingest.webhooks import bp as webhooks_bp
from ledger.config import Settings
from ledger.db import ProcessPool
from ledger.errors import ConfigError
from ledger.logs import configure as configure_logging
from ledger.deliveries import EventStore
from workers.app import make_celery
from workers.wakeup import Waker

log = logging.getLogger(__name__)


@dataclass
class LedgerExtension:
    settings: Settings
    secrets: tuple[str, ...]
    # The Connect and thin endpoints' own secrets; empty: that endpoint answers 404.
    connect_secrets: tuple[str, ...]
    thin_secrets: tuple[str, ...]
    store: EventStore
    waker: Waker
    pool: ProcessPool


def create_app(settings: Settings | None = None) -> Flask:
    if settings is None:
        configure_logging()
        try:
            settings = Settings.from_env()
            settings.require_webhook_secrets()
        except ConfigError as exc:
            # One clear line at start-up instead of a traceback (or a failure on the first request).
            # Exit status 3 is gunicorn's "worker failed to boot": the arbiter then stops. A
            # SystemExit carrying the message exits 1, and gunicorn answers that by booting
            # another worker, forever, instead of exiting.
            print(f"configuration error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(3) from None
    secrets = settings.require_webhook_secrets()

    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    pool = ProcessPool(settings, name="ingest", statement_timeout_ms=settings.db_statement_timeout_ms)
    app.extensions["ledger"] = LedgerExtension(
        settings=settings, secrets=secrets, connect_secrets=settings.connect_webhook_secrets,
        thin_secrets=settings.thin_webhook_secrets, store=EventStore(pool),
        waker=Waker(make_celery(settings, publisher_only=True)), pool=pool)
    app.register_blueprint(webhooks_bp)

    @app.get("/healthz")
    def healthz():
        return jsonify(status="ok")

    @app.get("/readyz")
    def readyz():
        ext = app.extensions["ledger"]
        checks = {"postgres": ext.store.ping(), "broker": ext.waker.ping()}
        return jsonify(ready=all(checks.values()), checks=checks), 200 if all(checks.values()) else 503

    @app.get("/metrics")
    def prometheus_metrics():
        data, content_type = metrics.render()
        return Response(data, content_type=content_type)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        # 404/405/413 and the like: JSON, never the HTML page, never the request body.
        return jsonify(outcome="rejected", error=exc.name.lower().replace(" ", "_"),
                       detail=exc.description), exc.code

    @app.errorhandler(Exception)
    def unexpected_error(exc: Exception):
        log.exception("unexpected error in the receiver", extra={"error_class": type(exc).__name__})
        return jsonify(outcome="error", error="internal_error"), 500

    return app
