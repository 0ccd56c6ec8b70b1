"""Settings read once from the environment and validated at start-up.

Every process (receiver, worker, sweep, ledgerctl) builds one ``Settings``;
a missing or malformed value raises ``ConfigError`` with one line that names
the variable, before the process serves anything.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Mapping
from urllib.parse import urlsplit

from ledger.errors import ConfigError

_DATABASE_SCHEMES = {"postgresql", "postgres"}
_BROKER_SCHEMES = {"redis", "rediss", "amqp", "amqps", "pyamqp", "memory"}
ACCEPT_LIVEMODE = ("live", "test", "both")


# Stripe retries a delivery for up to three days and its Events API lists 30 days: an event
# removed sooner could come back as new, and catch-up could no longer tell it was seen.
MINIMUM_WINDOW_DAYS = 30


@dataclass(frozen=True)
class RetentionPolicy:
    processed_days: int = 90
    failed_days: int = 365

    def __post_init__(self):
        for name, days in (("LEDGER_RETAIN_PROCESSED_DAYS", self.processed_days),
                           ("LEDGER_RETAIN_FAILED_DAYS", self.failed_days)):
            if days < MINIMUM_WINDOW_DAYS:
                raise ConfigError(f"{name} must be at least {MINIMUM_WINDOW_DAYS} (Stripe redelivers and its "
                                  f"Events API lists events for 30 days), got {days}")

    def params(self) -> dict[str, int]:
        return {"processed_days": self.processed_days, "failed_days": self.failed_days}


@dataclass(frozen=True)
class RetentionBudget:
    """How much of the machine a retention run may take (ledger/archive_builders.py): the processes that
    build its archive lines, their niceness (the run's own thread's too), and the archive rate they are
    held to (events a second over the run; 0: as fast as they go). The default is the rate a run keeps
    beside a stack taking 100 deliveries a second on two cores (docs/benchmarks.md, "Retention within a
    budget")."""
    max_rate: float = 12_000.0
    builders: int = 2
    nice: int = 10


@dataclass(frozen=True)
class Settings:
    database_url: str = "postgresql:///ledger"
    broker_url: str = "redis://localhost:6379/0"
    # Several secrets may be valid at once so a secret can be rolled without downtime.
    # Each endpoint verifies with its own list only: /webhooks/stripe with webhook_secrets,
    # /webhooks/stripe/connect with connect_webhook_secrets, /webhooks/stripe/thin (thin event
    # notifications of event destinations) with thin_webhook_secrets; the last two answer 404 while
    # their list is empty.
    webhook_secrets: tuple[str, ...] = ()
    connect_webhook_secrets: tuple[str, ...] = ()
    thin_webhook_secrets: tuple[str, ...] = ()
    # Events of the other mode are refused by the receiver (400 livemode_not_accepted).
    accept_livemode: str = "both"
    stripe_api_key: str | None = field(default=None, repr=False)
    stripe_api_base: str = "https://api.stripe.com"
    # Periodic catch-up in the sweep loop, every this many seconds; 0 = off.
    catchup_interval_s: float = 0.0
    # Workers: one request for what a thin notification points at. A failed fetch is not waited
    # out inside the attempt (which holds a lease): it fails the attempt, retried on our schedule.
    stripe_fetch_timeout_s: float = 10.0
    # Workers: how many of a batch's thin notifications are fetched at once (threads of each worker
    # process): Stripe answers in 100-400 ms, and a batch fetched one by one waits for each in turn.
    stripe_fetch_concurrency: int = 8
    signature_tolerance_s: int = 300
    max_body_bytes: int = 1024 * 1024
    # Receiver: how long a request may wait for a pooled connection / the INSERT.
    db_pool_timeout_s: float = 2.0
    db_statement_timeout_ms: int = 5000
    db_pool_max_size: int = 16
    # Receiver: a broker that does not answer within this is treated as down
    # (the row is durable; the sweep re-drives it).
    broker_timeout_s: float = 1.0
    queue_name: str = "stripe-events"
    # Workers: lease length, retry schedule.
    lease_s: int = 120
    # Workers: a host silent this long is dead to Postgres, which ends its sessions (ledger/db.py,
    # session_guards); the sweep's rescuer then takes its leases over (workers/rescue.py), looking
    # for gone workers every rescue_interval_s.
    dead_peer_s: float = 10.0
    rescue_interval_s: float = 1.0
    max_attempts: int = 8
    retry_base_s: float = 2.0
    retry_cap_s: float = 3600.0
    # Sweep: a wake-up is overdue after this long; at most this many per pass.
    sweep_overdue_s: float = 15.0
    sweep_batch: int = 500
    sweep_interval_s: float = 5.0
    # User handler modules (import paths) and the price/product -> features map.
    # Outbox: the product backend that receives the built-in effects
    # (entitlements.changed, invoice.payment_failed), signed with this secret.
    outbox_webhook_url: str | None = None
    outbox_webhook_secret: str | None = field(default=None, repr=False)
    outbox_timeout_s: float = 10.0
    # Workers and the sweep serve Prometheus metrics on this port when set.
    metrics_port: int | None = None
    # Celery task events (task-received/started/succeeded), which Flower's task
    # view lives on: three broker messages per task, a quarter of a worker's CPU
    # in ops/bench, so off unless someone watches tasks in Flower.
    task_events: bool = False
    handler_modules: tuple[str, ...] = ()
    entitlements_map_path: str | None = None
    # Retention (docs/retention.md): final events leave the ledger this many days after they
    # ended, archived first to archive_url; without one nothing leaves. At least 30 days each.
    retain_processed_days: int = 90
    retain_failed_days: int = 365
    archive_url: str | None = None
    # The sweep runs retention every this many seconds (0: only `ledgerctl retention run`).
    retention_interval_s: float = 3600.0
    # A run's budget (RetentionBudget): LEDGER_RETENTION_MAX_RATE, _BUILDERS, _NICE.
    retention_max_rate: float = RetentionBudget.max_rate
    retention_builders: int = RetentionBudget.builders
    retention_nice: int = RetentionBudget.nice

    def __post_init__(self):
        if self.accept_livemode not in ACCEPT_LIVEMODE:
            raise ConfigError(f"LEDGER_ACCEPT_LIVEMODE must be one of {'|'.join(ACCEPT_LIVEMODE)}, "
                              f"got {self.accept_livemode!r}")
        self.retention_policy()  # a window under 30 days stops every process at start-up

    def retention_policy(self) -> RetentionPolicy:
        return RetentionPolicy(processed_days=self.retain_processed_days, failed_days=self.retain_failed_days)

    def retention_budget(self) -> RetentionBudget:
        return RetentionBudget(max_rate=self.retention_max_rate, builders=self.retention_builders,
                               nice=self.retention_nice)

    def accepts_livemode(self, livemode: bool) -> bool:
        """Whether this deployment keeps events of this mode (LEDGER_ACCEPT_LIVEMODE)."""
        return self.accept_livemode == "both" or self.accept_livemode == ("live" if livemode else "test")

    def require_webhook_secrets(self) -> tuple[str, ...]:
        """The snapshot endpoint's secrets. A deployment that takes thin notifications only may leave
        STRIPE_WEBHOOK_SECRET unset (its /webhooks/stripe then answers 404); one with neither cannot verify
        anything."""
        if not self.webhook_secrets and not self.thin_webhook_secrets:
            raise ConfigError("STRIPE_WEBHOOK_SECRET is not set: the receiver cannot verify signatures "
                              "(a receiver of thin events only sets STRIPE_THIN_WEBHOOK_SECRET instead)")
        return self.webhook_secrets

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        defaults = cls()
        return cls(
            database_url=_url(env, "DATABASE_URL", defaults.database_url, _DATABASE_SCHEMES),
            broker_url=_url(env, "CELERY_BROKER_URL", defaults.broker_url, _BROKER_SCHEMES),
            webhook_secrets=_secrets(env, "STRIPE_WEBHOOK_SECRET"),
            connect_webhook_secrets=_secrets(env, "STRIPE_CONNECT_WEBHOOK_SECRET"),
            thin_webhook_secrets=_secrets(env, "STRIPE_THIN_WEBHOOK_SECRET"),
            accept_livemode=_choice(env, "LEDGER_ACCEPT_LIVEMODE", defaults.accept_livemode, ACCEPT_LIVEMODE),
            stripe_api_key=env.get("STRIPE_API_KEY") or None,
            stripe_api_base=_optional_http_url(env, "STRIPE_API_BASE") or defaults.stripe_api_base,
            catchup_interval_s=_number(env, "LEDGER_CATCHUP_INTERVAL_S", defaults.catchup_interval_s, float, minimum=0),
            stripe_fetch_timeout_s=_number(env, "STRIPE_FETCH_TIMEOUT_S", defaults.stripe_fetch_timeout_s, float,
                                           minimum=0.1),
            stripe_fetch_concurrency=_number(env, "STRIPE_FETCH_CONCURRENCY", defaults.stripe_fetch_concurrency, int,
                                             minimum=1),
            signature_tolerance_s=_number(env, "STRIPE_SIGNATURE_TOLERANCE_S", defaults.signature_tolerance_s, int, minimum=1),
            max_body_bytes=_number(env, "INGEST_MAX_BODY_BYTES", defaults.max_body_bytes, int, minimum=1024),
            db_pool_timeout_s=_number(env, "DB_POOL_TIMEOUT_S", defaults.db_pool_timeout_s, float, minimum=0.1),
            db_statement_timeout_ms=_number(env, "DB_STATEMENT_TIMEOUT_MS", defaults.db_statement_timeout_ms, int, minimum=100),
            db_pool_max_size=_number(env, "DB_POOL_MAX_SIZE", defaults.db_pool_max_size, int, minimum=1),
            broker_timeout_s=_number(env, "BROKER_TIMEOUT_S", defaults.broker_timeout_s, float, minimum=0.1),
            queue_name=env.get("LEDGER_QUEUE", defaults.queue_name) or defaults.queue_name,
            lease_s=_number(env, "LEDGER_LEASE_S", defaults.lease_s, int, minimum=5),
            dead_peer_s=_number(env, "LEDGER_DEAD_PEER_S", defaults.dead_peer_s, float, minimum=2),
            rescue_interval_s=_number(env, "LEDGER_RESCUE_INTERVAL_S", defaults.rescue_interval_s, float, minimum=0.1),
            max_attempts=_number(env, "LEDGER_MAX_ATTEMPTS", defaults.max_attempts, int, minimum=1),
            retry_base_s=_number(env, "LEDGER_RETRY_BASE_S", defaults.retry_base_s, float, minimum=0.01),
            retry_cap_s=_number(env, "LEDGER_RETRY_CAP_S", defaults.retry_cap_s, float, minimum=0.01),
            sweep_overdue_s=_number(env, "LEDGER_SWEEP_OVERDUE_S", defaults.sweep_overdue_s, float, minimum=0.1),
            sweep_batch=_number(env, "LEDGER_SWEEP_BATCH", defaults.sweep_batch, int, minimum=1),
            sweep_interval_s=_number(env, "LEDGER_SWEEP_INTERVAL_S", defaults.sweep_interval_s, float, minimum=0.1),
            outbox_webhook_url=_optional_http_url(env, "OUTBOX_WEBHOOK_URL"),
            outbox_webhook_secret=_outbox_secret(env),
            outbox_timeout_s=_number(env, "OUTBOX_TIMEOUT_S", defaults.outbox_timeout_s, float, minimum=0.1),
            metrics_port=_number(env, "METRICS_PORT", None, int, minimum=1),
            task_events=_flag(env, "LEDGER_TASK_EVENTS", defaults.task_events),
            handler_modules=tuple(m.strip() for m in env.get("LEDGER_HANDLER_MODULES", "").split(",") if m.strip()),
            entitlements_map_path=env.get("LEDGER_ENTITLEMENTS_MAP") or None,
            retain_processed_days=_number(env, "LEDGER_RETAIN_PROCESSED_DAYS", defaults.retain_processed_days, int,
                                          minimum=1),
            retain_failed_days=_number(env, "LEDGER_RETAIN_FAILED_DAYS", defaults.retain_failed_days, int, minimum=1),
            archive_url=env.get("LEDGER_ARCHIVE_URL", "").strip() or None,
            retention_interval_s=_number(env, "LEDGER_RETENTION_INTERVAL_S", defaults.retention_interval_s, float,
                                         minimum=0),
            retention_max_rate=_number(env, "LEDGER_RETENTION_MAX_RATE", defaults.retention_max_rate, float, minimum=0),
            retention_builders=_number(env, "LEDGER_RETENTION_BUILDERS", defaults.retention_builders, int, minimum=1),
            retention_nice=_number(env, "LEDGER_RETENTION_NICE", defaults.retention_nice, int, minimum=0, maximum=19),
        )


def _url(env: Mapping[str, str], name: str, default: str, schemes: set[str]) -> str:
    value = env.get(name, "").strip() or default
    scheme = _scheme(name, value)
    if scheme not in schemes:
        raise ConfigError(f"{name} must be a URL with scheme {'/'.join(sorted(schemes))}, got scheme {scheme!r}")
    return value


def _optional_http_url(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if _scheme(name, value) not in {"http", "https"}:
        raise ConfigError(f"{name} must be an http(s) URL")
    return value


def _scheme(name: str, value: str) -> str:
    try:
        return urlsplit(value).scheme
    except ValueError:
        raise ConfigError(f"{name} is not a valid URL") from None


def _outbox_secret(env: Mapping[str, str]) -> str | None:
    secret = env.get("OUTBOX_WEBHOOK_SECRET", "").strip() or None
    if env.get("OUTBOX_WEBHOOK_URL", "").strip() and (secret is None or len(secret) < 16):
        raise ConfigError("OUTBOX_WEBHOOK_SECRET must be set (16+ characters) when OUTBOX_WEBHOOK_URL is set")
    return secret


def _secrets(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    secrets = tuple(s.strip() for s in env.get(name, "").split(",") if s.strip())
    for index, secret in enumerate(secrets, start=1):
        if not secret.startswith("whsec_") or len(secret) < 10:
            # Never echo the value: it is a secret.
            raise ConfigError(f"{name} entry {index} is malformed: each entry must start with 'whsec_'")
    return secrets


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in choices:
        raise ConfigError(f"{name} must be one of {'|'.join(choices)}, got {raw!r}")
    return raw


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in {"1", "true", "yes", "on"}:
        return True
    if raw in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name} must be true or false, got {raw!r}")


def _number(env: Mapping[str, str], name: str, default, kind, minimum, maximum=math.inf):
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a{'n integer' if kind is int else ' number'}, got {raw!r}") from None
    if not math.isfinite(value) or value < minimum:
        # nan compares false with everything: it would pass a bare minimum check.
        raise ConfigError(f"{name} must be a finite number of at least {minimum}, got {raw!r}")
    if value > maximum:
        raise ConfigError(f"{name} must be at most {maximum}, got {raw!r}")
    return value
