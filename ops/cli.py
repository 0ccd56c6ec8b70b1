"""ledgerctl: the operator's command line.

Human tables by default, ``--json`` for scripts. Exit codes: 0 done, 1 the
command ran but found nothing / not everything succeeded, 2 bad usage or
configuration; ``catchup`` adds 3 (an unrecoverable gap) and 4 (another
catch-up of the account is running).
"""
from __future__ import annotations

import getpass
import json
import os
import re
import socket
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable

import click

from ledger.config import Settings
from ledger.errors import ConfigError, LedgerError
from ledger.states import EventStatus, OutboxStatus

_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class _Context:
    def __init__(self):
        self._settings: Settings | None = None
        self._pool = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_env()
        return self._settings

    @property
    def pool(self):
        from ledger.db import ProcessPool

        if self._pool is None:
            self._pool = ProcessPool(self.settings, name="ledgerctl", max_size=2)
        return self._pool

    @property
    def operator(self):
        from ledger.operator import OperatorLedger

        return OperatorLedger(self.pool)

    def waker(self):
        from workers.app import make_celery
        from workers.wakeup import Waker

        return Waker(make_celery(self.settings, publisher_only=True))

    def stripe_api(self):
        from workers.stripe_api import StripeApi

        return StripeApi(self.settings)


def _duration_s(value: str) -> float:
    match = _DURATION.match(value.strip())
    if not match:
        raise click.BadParameter(f"{value!r} is not a duration like 90d, 12h, 30m or 45s")
    return int(match[1]) * _UNITS[match[2]]


def _when(value: str | None) -> datetime | None:
    """An ISO time, or a duration meaning that long ago (e.g. 24h)."""
    if value is None:
        return None
    if _DURATION.match(value.strip()):
        return datetime.now(timezone.utc) - timedelta(seconds=_duration_s(value))
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither an ISO time nor a duration like 24h") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "__float__") and not isinstance(value, (int, float, bool)):
        return float(value)
    return value


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(_plain(value), indent=2, sort_keys=True))


def _found(value, missing: str):
    """``value``, or exit 1 saying what was not found (an unknown id is not a usage error)."""
    if value is None:
        click.echo(missing, err=True)
        sys.exit(1)
    return value


def _table(rows: Iterable[dict[str, Any]], columns: list[str]) -> None:
    rows = [{c: "" if r.get(c) is None else str(_plain(r.get(c))) for c in columns} for r in rows]
    widths = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in columns}
    click.echo("  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip())
    for r in rows:
        click.echo("  ".join(r[c].ljust(widths[c]) for c in columns).rstrip())


def _values(*statuses: EventStatus | OutboxStatus) -> list[str]:
    """Choices as plain strings: click matches an Enum choice by its name, not its value."""
    return [status.value for status in statuses]


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
status_choice = click.Choice(_values(*EventStatus))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def cli(ctx: click.Context):
    """Operate the Stripe event ledger (configuration comes from the environment)."""
    ctx.obj = _Context()


@cli.command()
@click.option("--check", is_flag=True, help="Only report pending migrations; exit 1 if any.")
@click.pass_obj
def migrate(obj: _Context, check: bool):
    """Create or upgrade the ledger and billing schemas (idempotent, additive)."""
    from ledger import migrate as migrations

    if check:
        todo = migrations.pending(obj.settings.database_url)
        for m in todo:
            click.echo(f"pending {m.version:04d}_{m.name}")
        sys.exit(1 if todo else 0)
    applied = migrations.migrate(obj.settings.database_url)
    for m in applied:
        click.echo(f"applied {m.version:04d}_{m.name}")
    click.echo(f"schema up to date ({len(applied)} applied)")


@cli.command()
@json_option
@click.pass_obj
def stats(obj: _Context, as_json: bool):
    """Counts by status and type, oldest unprocessed age, due retries, expired leases, queue depth."""
    from workers.app import make_celery
    from workers.sweep import queue_depth

    result = obj.operator.stats()
    result["queue_depth"] = queue_depth(make_celery(obj.settings, publisher_only=True), obj.settings.queue_name)
    if as_json:
        _echo_json(result)
        return
    for status in EventStatus:
        click.echo(f"{status.value:20} {result['by_status'].get(status.value, 0)}")
    age = result["oldest_unprocessed_age_s"]
    click.echo(f"{'oldest unprocessed':20} {'-' if age is None else f'{age:.1f}s'}")
    for key in ("due_retries", "scheduled_retries", "expired_leases", "in_progress", "queue_depth"):
        value = result[key]
        click.echo(f"{key.replace('_', ' '):20} {'unknown (broker unreachable)' if value is None else value}")
    if result["by_status_and_type"]:
        click.echo("")
        _table(result["by_status_and_type"], ["status", "type", "events"])


@cli.group()
def events():
    """Inspect events."""


@events.command("list")
@click.option("--status", type=status_choice, help="Only events in this state.")
@click.option("--type", "type_glob", help="Event type, glob allowed (invoice.*).")
@click.option("--since", help="Received at or after (ISO time, or a duration ago: 24h).")
@click.option("--until", help="Received before (ISO time, or a duration ago).")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 100_000))
@json_option
@click.pass_obj
def events_list(obj: _Context, status, type_glob, since, until, limit, as_json):
    """List events, newest first."""
    from ledger.operator import EventFilter

    rows = obj.operator.list_events(EventFilter(status, type_glob, _when(since), _when(until)), limit)
    if as_json:
        _echo_json(rows)
    else:
        _table(rows, ["id", "type", "status", "attempts", "failure_reason", "received_at"])


@events.command("show")
@click.argument("event_id")
@json_option
@click.pass_obj
def events_show(obj: _Context, event_id: str, as_json: bool):
    """One event: its row, deliveries, attempts with errors, operator actions, business rows it wrote."""
    detail = _found(obj.operator.show(event_id), f"no event {event_id}")
    if as_json:
        _echo_json(detail)
        return
    for key, value in detail["event"].items():
        click.echo(f"{key:18} {'' if value is None else _plain(value)}")
    click.echo(f"{'last delivered':18} {_plain(detail['deliveries']['last_delivered_at'])}")
    click.echo("\nattempts")
    _table(detail["attempts"], ["attempt", "worker", "started_at", "finished_at", "outcome", "error_class", "error"])
    if detail["audit"]:
        click.echo("\noperator actions")
        _table(detail["audit"], ["at", "action", "actor", "from_status", "reason"])
    click.echo("\nbusiness rows written by this event")
    _table(detail["domain_rows"], ["table_name", "row_id"])


@cli.command()
@click.argument("event_ids", nargs=-1)
@click.option("--status", "bulk_status", type=click.Choice(_values(EventStatus.FAILED_PERMANENT,
                                                                   EventStatus.FAILED_RECOVERABLE,
                                                                   EventStatus.PROCESSED)),
              help="Bulk: replay every event in this state (processed needs --force).")
@click.option("--type", "type_glob", help="Bulk: only this event type (glob allowed).")
@click.option("--since", help="Bulk: received at or after (ISO time or duration ago).")
@click.option("--until", help="Bulk: received before (ISO time or duration ago).")
@click.option("--reason", help="Bulk: only events that failed with this reason (e.g. unsupported_type).")
@click.option("--why", "why", help="Why you replay: recorded in the audit history.")
@click.option("--force", is_flag=True, help="Also replay processed events (business writes are idempotent).")
@click.option("--dry-run", is_flag=True, help="Print what would be replayed; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation of a bulk replay.")
@click.option("--rate", type=click.FloatRange(min=0.1), default=50.0, show_default=True,
              help="At most this many replays per second, so live traffic keeps its workers.")
@json_option
@click.pass_obj
def replay(obj: _Context, event_ids, bulk_status, type_glob, since, until, reason, why, force, dry_run, yes,
           rate, as_json):
    """Move events back to `received` and wake a worker for each.

    Either name events (ledgerctl replay evt_1 evt_2) or select them in bulk
    (ledgerctl replay --status failed_permanent --reason unsupported_type).
    Events being processed or already waiting are left alone.
    """
    from ledger.operator import EventFilter

    if bool(event_ids) == bool(bulk_status):
        raise click.UsageError("name event ids, or select them with --status (not both)")
    if bulk_status == EventStatus.PROCESSED and not force:
        raise click.UsageError("replaying processed events needs --force")
    bulk = bool(bulk_status)
    if bulk:
        ids = list(obj.operator.ids_for_replay(EventFilter(bulk_status, type_glob, _when(since), _when(until),
                                                           reason)))
    else:
        ids = list(dict.fromkeys(event_ids))

    if dry_run:
        if as_json:
            _echo_json({"would_replay": ids})
        else:
            for event_id in ids:
                click.echo(event_id)
            click.echo(f"{len(ids)} event(s) would be replayed (dry run, nothing changed)", err=True)
        return
    if bulk and ids and not yes:
        click.confirm(f"Replay {len(ids)} event(s)?", abort=True, err=True)

    actor = f"{getpass.getuser()}@{socket.gethostname()}"
    waker = obj.waker()
    replayed, skipped = [], []
    interval = 1.0 / rate
    next_at = time.monotonic()
    with click.progressbar(ids, label="replaying", file=sys.stderr,
                           hidden=len(ids) < 100 or as_json) as bar:
        for event_id in bar:
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            next_at = max(next_at, time.monotonic()) + interval
            from_status = obj.operator.replay(event_id, actor=actor, reason=why, force=force)
            if from_status is None:
                skipped.append(event_id)
                continue
            waker.wake(event_id)
            replayed.append({"id": event_id, "from_status": from_status})
    if as_json:
        _echo_json({"replayed": replayed, "skipped": skipped})
    else:
        for item in replayed:
            click.echo(f"replayed {item['id']} (was {item['from_status']})")
        for event_id in skipped:
            click.echo(f"skipped  {event_id} (unknown, being processed, already waiting, processed without "
                       f"--force, or payload pruned)")
        click.echo(f"{len(replayed)} replayed, {len(skipped)} skipped", err=True)
    sys.exit(1 if skipped or not ids else 0)


@cli.command()
@click.option("--loop", is_flag=True, help="Run forever, one pass every LEDGER_SWEEP_INTERVAL_S.")
@json_option
@click.pass_obj
def sweep(obj: _Context, loop: bool, as_json: bool):
    """Re-drive overdue wake-ups: lost enqueues, dead workers, due retries.

    Safe to run in several replicas at once. With --loop and METRICS_PORT set,
    serves Prometheus metrics, including ledger gauges read from Postgres.
    """
    from ledger.logs import configure as configure_logging
    from workers.app import make_celery
    from workers.runtime import Runtime

    configure_logging()
    runtime = Runtime(obj.settings, make_celery(obj.settings))
    if loop:
        if obj.settings.metrics_port:
            # The sweep is the natural home of ledger-wide gauges: one per deployment, always running.
            from workers.metrics import serve

            serve(obj.settings.metrics_port, operator=obj.operator, outbox=_outbox(obj))
        runtime.sweeper.run_forever()
        return
    result = runtime.sweeper.run_once()
    if as_json:
        _echo_json(result.__dict__)
    else:
        click.echo(f"re-drove {result.redriven} event(s) and {result.effects_redriven} effect(s); "
                   f"queue depth {result.queue_depth}"
                   + (" (skipped: broker backlog)" if result.skipped_backlog else ""))


@cli.command()
@click.option("--older-than", "older_than", required=True, help="Retention, e.g. 90d.")
@click.option("--dry-run", is_flag=True, help="Only count what would be pruned.")
@json_option
@click.pass_obj
def prune(obj: _Context, older_than: str, dry_run: bool, as_json: bool):
    """Drop payloads of processed events past retention. Unprocessed events are never touched."""
    seconds = _duration_s(older_than)
    if dry_run:
        count = obj.operator.count_prunable(older_than_s=seconds)
        if as_json:
            _echo_json({"would_prune": count})
        else:
            click.echo(f"{count} payload(s) would be pruned (dry run, nothing changed)")
        return
    total = sum(obj.operator.prune_payloads(older_than_s=seconds))
    if as_json:
        _echo_json({"pruned": total})
    else:
        click.echo(f"pruned {total} payload(s)")


def _account(value: str | None) -> str | None:
    if value is not None and not re.fullmatch(r"acct_[A-Za-z0-9]+", value):
        raise click.BadParameter(f"{value!r} is not a connected account id (acct_...)", param_hint="--account")
    return value


def _collections(names) -> list:
    from workers.backfill import collections_named

    try:
        return collections_named(names)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="OBJECT_TYPES") from None


def _progress(as_json: bool):
    """click's progress bar on stderr, shown only on a terminal (stdout a TTY) and never with --json."""
    hidden = as_json or not sys.stdout.isatty()

    def bar(items, label: str = "recording"):
        return click.progressbar(items, label=label, file=sys.stderr, hidden=hidden)
    return bar


def _log_warnings() -> None:
    """JSON log lines on stderr, WARNING and up unless LOG_LEVEL says otherwise: retries of Stripe's API,
    events no webhook had delivered, a gap."""
    from ledger.logs import configure as configure_logging

    configure_logging(os.environ.get("LOG_LEVEL") or "WARNING")


def _stripe_failed(exc) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


account_option = click.option("--account", callback=lambda ctx, param, value: _account(value),
                              help="A connected account (acct_...): its events and objects. Default: the platform.")


@cli.command()
@click.option("--since", help="Events created at or after this: an ISO time, or a duration ago (72h). "
                              "Stripe lists the last 30 days.")
@click.option("--from-cursor", is_flag=True,
              help="From where the last catch-up of the account ended (the default without --since, --types "
                   "or --undelivered; the whole 30 days on the first run).")
@click.option("--types", "types", multiple=True,
              help="Only these event types (repeat, or comma-separated). Leaves the cursor alone.")
@account_option
@click.option("--undelivered", is_flag=True,
              help="Only events whose webhook delivery failed (delivery_success=false): the cheap daily check. "
                   "Leaves the cursor alone.")
@click.option("--dry-run", is_flag=True, help="List and count only: record, wake and move nothing.")
@json_option
@click.pass_obj
def catchup(obj: _Context, since, from_cursor, types, account, undelivered, dry_run, as_json):
    """Record the events Stripe has that no webhook delivered, oldest first, and wake workers for them.

    Each is recorded exactly as a webhook delivery is (same dedupe; its delivery row says `catchup`).
    Exit status: 0 done; 1 Stripe's API failed (retries used up, or a permanent error); 2 bad usage
    or configuration; 3 an unrecoverable gap (older than Stripe's 30 days; what was still listed is
    caught up, the message names the backfill that repairs it); 4 another catch-up of the same
    account is running (nothing done).
    """
    from workers.catchup import CatchUp, CatchupBusy, CatchupRequest
    from workers.stripe_api import StripeApiError

    _log_warnings()
    types = tuple(t.strip() for value in types for t in value.split(",") if t.strip())
    if since is None and not types and not undelivered:
        from_cursor = True
    try:
        request = CatchupRequest(account=account, since=_when(since), from_cursor=from_cursor, types=types,
                                 undelivered=undelivered, dry_run=dry_run)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    runner = CatchUp(obj.settings, obj.pool, obj.stripe_api(), None if dry_run else obj.waker())
    try:
        report = runner.run(request, progress=_progress(as_json))
    except CatchupBusy as exc:
        click.echo(str(exc), err=True)
        sys.exit(4)
    except StripeApiError as exc:
        _stripe_failed(exc)
    if as_json:
        _echo_json(report.as_dict())
    else:
        who = f"account {account}" if account else "the platform"
        start = "the whole 30-day window" if report.listed_from is None else \
            f"events created since {report.listed_from.isoformat(timespec='seconds')}"
        click.echo(f"catch-up of {who}{' from the cursor' if report.from_cursor else ''}: {start}")
        if report.dry_run:
            click.echo(f"listed {report.listed}: {report.missed} would be recorded (no webhook delivered them), "
                       f"{report.duplicates} already in the ledger (dry run, nothing changed)")
        else:
            click.echo(f"listed {report.listed}: recorded {report.recorded} ({report.missed} no webhook had "
                       f"delivered, {report.duplicates} duplicates), skipped {report.skipped} already recorded "
                       f"behind the cursor; woke {report.woken}")
            if report.refused_mode:
                click.echo(f"  not recorded: {report.refused_mode} of a mode LEDGER_ACCEPT_LIVEMODE refuses")
            for type_, count in sorted(report.missed_by_type.items()):
                click.echo(f"  missed {type_}: {count}")
            if report.cursor and report.cursor["last_event_id"]:
                click.echo(f"cursor at {report.cursor['last_event_id']} (created "
                           f"{report.cursor['last_event_created'].isoformat(timespec='seconds')})")
    if report.gap is not None:
        click.echo(report.gap.message(), err=True)
        sys.exit(3)


@cli.command()
@click.argument("object_types", nargs=-1, required=True)
@click.option("--created-since", help="Only objects created at or after this (ISO time, or a duration ago: 90d).")
@account_option
@click.option("--dry-run", is_flag=True, help="Fetch and count only; write nothing.")
@json_option
@click.pass_obj
def backfill(obj: _Context, object_types, created_since, account, dry_run, as_json):
    """Fetch Stripe's current objects and apply each under the events' order guard.

    OBJECT_TYPES: customers subscriptions invoices checkout_sessions products prices charges
    payment_intents refunds disputes payment_methods setup_intents credit_notes coupons
    promotion_codes tax_rates, or all. Subscriptions are listed with status=all (canceled ones
    too). A snapshot never overwrites a newer event's state, nor does an older event overwrite it
    (README, Backfill). Exit status: 0 done, 1 Stripe's API failed, 2 bad usage or configuration.
    """
    from workers.backfill import Backfill
    from workers.stripe_api import StripeApiError

    _log_warnings()
    collections = _collections(object_types)
    runner = Backfill(obj.pool, obj.stripe_api())
    try:
        results = runner.run(collections, created_since=_when(created_since), account=account, dry_run=dry_run,
                             progress=_progress(as_json))
    except StripeApiError as exc:
        _stripe_failed(exc)
    rows = [r.__dict__ for r in results]
    if as_json:
        _echo_json({"account": account, "dry_run": dry_run, "types": rows})
        return
    _table(rows, ["type", "fetched"] if dry_run else ["type", "fetched", "applied", "kept", "refused", "unmappable"])
    if dry_run:
        click.echo("(dry run, nothing written)", err=True)


@cli.command()
@click.argument("object_types", nargs=-1)
@account_option
@click.option("--fix", is_flag=True, help="Apply Stripe's current objects where they drifted (the backfill path).")
@json_option
@click.pass_obj
def reconcile(obj: _Context, object_types, account, fix, as_json):
    """Compare local rows with Stripe's current objects and print the drift.

    OBJECT_TYPES as for backfill (default: customers subscriptions invoices). Drift: missing_locally,
    missing_at_stripe, stale_status, wrong_period, wrong_amount, stale_field. Exit status: 0 no drift
    (with --fix: every drift fixed), 1 drift (with --fix: some could not be fixed) or Stripe's API
    failed, 2 bad usage or configuration.
    """
    from workers.reconcile import Reconcile
    from workers.stripe_api import StripeApiError

    _log_warnings()
    collections = _collections(object_types or ("customers", "subscriptions", "invoices"))
    runner = Reconcile(obj.pool, obj.stripe_api())
    try:
        result = runner.compare(collections, account=account)
        if fix:
            runner.fix(result, collections)
    except StripeApiError as exc:
        _stripe_failed(exc)
    failed = [f for f in result.fixes if not f.fixed]
    if as_json:
        _echo_json(result.as_dict())
    else:
        if result.drift:
            _table([d.__dict__ for d in result.drift], ["type", "id", "kind", "field", "local", "stripe"])
        for name, counts in result.checked.items():
            click.echo(f"{name}: {counts['local']} local, {counts['stripe']} at Stripe")
        click.echo(f"{len(result.drift)} drift(s)" if result.drift else "no drift")
        if fix and result.fixes:
            click.echo("")
            _table([f.__dict__ for f in result.fixes], ["type", "id", "fixed", "note"])
            click.echo(f"fixed {len(result.fixes) - len(failed)} object(s), {len(failed)} not fixed")
    sys.exit((1 if failed else 0) if fix else (1 if result.drift else 0))


@cli.group()
def outbox():
    """Inspect and replay external effects (the transactional outbox)."""


def _outbox(obj: _Context):
    from ledger.outbox import OutboxLedger

    return OutboxLedger(obj.pool)


@outbox.command("list")
@click.option("--status", type=click.Choice(_values(*OutboxStatus)))
@click.option("--effect", "effect_glob", help="Effect name, glob allowed (entitlements.*).")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 100_000))
@json_option
@click.pass_obj
def outbox_list(obj: _Context, status, effect_glob, limit, as_json):
    """List recorded effects, newest first."""
    from ledger.operator import glob_to_like

    rows = _outbox(obj).list(status=status, effect_like=glob_to_like(effect_glob), limit=limit)
    if as_json:
        _echo_json(rows)
    else:
        _table(rows, ["id", "effect", "status", "attempts", "failure_reason", "idempotency_key", "created_at"])


@outbox.command("show")
@click.argument("outbox_id", type=int)
@json_option
@click.pass_obj
def outbox_show(obj: _Context, outbox_id: int, as_json: bool):
    """One effect: its row, payload and last error."""
    row = _found(_outbox(obj).get(outbox_id), f"no effect {outbox_id}")
    if as_json:
        _echo_json(row)
        return
    for key, value in row.items():
        shown = json.dumps(value, sort_keys=True) if isinstance(value, dict) else _plain(value)
        click.echo(f"{key:18} {'' if value is None else shown}")


@outbox.command("replay")
@click.argument("outbox_ids", nargs=-1, type=int)
@click.option("--status", "bulk_status", type=click.Choice(_values(OutboxStatus.FAILED_PERMANENT,
                                                                   OutboxStatus.FAILED_RECOVERABLE,
                                                                   OutboxStatus.SENT)),
              help="Bulk: every effect in this state (sent needs --force).")
@click.option("--effect", "effect_glob", help="Bulk: only this effect (glob allowed).")
@click.option("--force", is_flag=True, help="Also re-send effects already sent (same idempotency key).")
@click.option("--dry-run", is_flag=True, help="Print what would be replayed; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation of a bulk replay.")
@json_option
@click.pass_obj
def outbox_replay(obj: _Context, outbox_ids, bulk_status, effect_glob, force, dry_run, yes, as_json):
    """Move effects back to pending and wake a dispatcher for each."""
    from ledger.operator import glob_to_like

    if bool(outbox_ids) == bool(bulk_status):
        raise click.UsageError("name effect ids, or select them with --status (not both)")
    if bulk_status == OutboxStatus.SENT and not force:
        raise click.UsageError("re-sending sent effects needs --force")
    ledger = _outbox(obj)
    ids = list(ledger.ids_for_replay(status=bulk_status, effect_like=glob_to_like(effect_glob))) if bulk_status \
        else list(dict.fromkeys(outbox_ids))
    if dry_run:
        _echo_json({"would_replay": ids}) if as_json else click.echo("\n".join(map(str, ids)) or "nothing")
        return
    if bulk_status and ids and not yes:
        click.confirm(f"Replay {len(ids)} effect(s)?", abort=True, err=True)
    waker = obj.waker()
    replayed = [i for i in ids if ledger.replay(i, force=force)]
    for outbox_id in replayed:
        waker.wake_effect(outbox_id)
    skipped = [i for i in ids if i not in set(replayed)]
    if as_json:
        _echo_json({"replayed": replayed, "skipped": skipped})
    else:
        click.echo(f"{len(replayed)} replayed, {len(skipped)} skipped"
                   + (f" (not failed, or sent without --force: {skipped})" if skipped else ""))
    sys.exit(1 if skipped or not ids else 0)


@cli.command()
@json_option
@click.pass_obj
def handlers(obj: _Context, as_json: bool):
    """Every registered handler pattern, in the order handlers run, with the fields the handler requires.

    The registry a worker with this environment loads (LEDGER_HANDLER_MODULES, entry points). An event
    lacking a required field ends failed_permanent / unmappable_payload; "a or b": either one will do.
    """
    from workers.handlers import describe, handler_name
    from workers.registry import load_handlers

    try:
        registry = load_handlers(obj.settings)
    except ImportError as exc:  # what a worker would die of at start-up: one line, not a traceback
        click.echo(f"error: a handler module cannot be imported: {exc}", err=True)
        sys.exit(2)
    rows = [{"pattern": entry.pattern,
             "handler": f"{getattr(entry.handler, '__module__', None) or type(entry.handler).__module__}."
                        f"{handler_name(entry.handler)}",
             "requires": [r if isinstance(r, str) else list(r) for r in entry.requires],
             "shown": ", ".join(describe(r) for r in entry.requires) or "-"}
            for entry in registry.entries()]
    if as_json:
        _echo_json([{k: v for k, v in row.items() if k != "shown"} for row in rows])
    else:
        _table([{**row, "requires": row["shown"]} for row in rows], ["pattern", "handler", "requires"])


@cli.command()
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True)
@json_option
@click.pass_obj
def health(obj: _Context, limit: int, as_json: bool):
    """Stripe's health alerts: events Stripe failed to generate, and what the workers did about each.

    repair: applied (the object was refetched and applied), object_not_found (Stripe no longer has
    it), unsupported_object_type (the workers cannot fetch that type: look at the object in the Dashboard
    and repair what depends on it by hand).
    """
    rows = obj.operator.health_alerts(limit)
    if as_json:
        _echo_json(rows)
        return
    _table([{**row, "account": row["account"] or "-"} for row in rows],
           ["recorded_at", "failed_event_type", "related_object_type", "related_object_id", "account", "repair",
            "event_id"])


@cli.command("send-test-event")
@click.option("--url", default="http://127.0.0.1:8000/webhooks/stripe", show_default=True,
              help="The receiver's webhook URL.")
@click.option("--file", "path", type=click.Path(exists=True, dir_okay=False),
              help="A Stripe event JSON file to send (default: a fresh customer.created).")
@click.option("--print-curl", is_flag=True, help="Print a ready-to-paste signed curl command instead of sending.")
@click.pass_obj
def send_test_event(obj: _Context, url: str, path: str | None, print_curl: bool):
    """Sign an event with STRIPE_WEBHOOK_SECRET exactly as Stripe does and deliver it."""
    import shlex
    import urllib.error
    import urllib.request

    import secrets

    import stripe

    secrets_ = obj.settings.require_webhook_secrets()
    if not secrets_:
        raise click.UsageError("STRIPE_WEBHOOK_SECRET is not set: send-test-event signs a snapshot event with it")
    secret = secrets_[-1]
    if path:
        with open(path, encoding="utf-8") as fh:
            body = fh.read()
    else:
        customer, now = f"cus_{secrets.token_hex(12)}", int(time.time())
        body = json.dumps({
            "id": f"evt_{secrets.token_hex(12)}", "object": "event", "api_version": "2020-08-27", "created": now,
            "data": {"object": {"id": customer, "object": "customer", "email": f"{customer}@example.test",
                                "metadata": {}}},
            "livemode": False, "pending_webhooks": 1, "request": {"id": None, "idempotency_key": None},
            "type": "customer.created"}, separators=(",", ":"))
    header = stripe.WebhookSignature.generate_signature_header(body, secret)
    if print_curl:
        click.echo(f"curl -sS -X POST {shlex.quote(url)} -H 'Content-Type: application/json' "
                   f"-H {shlex.quote('Stripe-Signature: ' + header)} --data-binary {shlex.quote(body)}")
        return
    request = urllib.request.Request(url, data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Stripe-Signature": header})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            click.echo(f"{response.status} {response.read().decode()}")
    except urllib.error.HTTPError as exc:
        click.echo(f"{exc.code} {exc.read().decode()}")
        sys.exit(1)
    except urllib.error.URLError as exc:
        click.echo(f"receiver not reachable at {url}: {exc.reason}", err=True)
        sys.exit(1)


def main():
    import logging

    import psycopg
    from psycopg_pool import PoolTimeout

    # The pool's own reconnect warnings would bury the one line an operator needs.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    try:
        cli(standalone_mode=True)
    except (ConfigError, LedgerError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except (PoolTimeout, psycopg.OperationalError) as exc:
        click.echo(f"error: the ledger database is unreachable ({type(exc).__name__})", err=True)
        sys.exit(1)
