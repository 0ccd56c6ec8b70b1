"""ledgerctl: the commands that talk to Stripe (catchup, backfill, reconcile), its health alerts,
and send-test-event."""
from __future__ import annotations

import json
import os
import re
import sys
import time

import click
from ops.cli.base import _Context, _actor, _echo_json, _table, _when, cli, json_option


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
    (docs/stripe-api.md, "ledgerctl backfill"). Exit status: 0 done, 1 Stripe's API failed, 2 bad usage or configuration.
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
        result = runner.run(collections, account=account, fix=fix, actor=_actor())
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

    from ledger.stripe_events import InvalidEvent, parse_event

    secrets_ = obj.settings.require_webhook_secrets()
    if not secrets_:
        raise click.UsageError("STRIPE_WEBHOOK_SECRET is not set: send-test-event signs a snapshot event with it")
    secret = secrets_[-1]
    if path:
        with open(path, encoding="utf-8") as fh:
            body = fh.read()
        try:
            parse_event(body.encode())  # the receiver's own check: a file it would refuse is not sent
        except InvalidEvent as exc:
            raise click.UsageError(f"{path} is not a snapshot event the receiver records: {exc}") from None
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


