"""ledgerctl: the ledger's own commands: migrate, stats, events, replay, sweep, prune, handlers."""
from __future__ import annotations

import sys

import click

from ledger.states import EventStatus
from ops.cli.base import (_Context, _actor, _duration_s, _echo_json, _found, _plain, _table, _values, _when, cli,
                          json_option, status_choice)


@cli.command()
@click.option("--check", is_flag=True, help="Only report pending migrations; exit 1 if any.")
@click.pass_obj
def migrate(obj: _Context, check: bool):
    """Create or upgrade the ledger and billing schemas (idempotent, additive; an index on a large table is
    built concurrently, and says so)."""
    from ledger import migrate as migrations

    if check:
        todo = migrations.pending(obj.settings.database_url)
        for m in todo:
            click.echo(f"pending {m.version:04d}_{m.name}")
        sys.exit(1 if todo else 0)
    applied = migrations.migrate(obj.settings.database_url, say=click.echo)
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
    from ledger.event_query import EventQuery

    rows = obj.operator.list_events(EventQuery(status=status, type_glob=type_glob, since=_when(since),
                                               until=_when(until)), limit)
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
    from workers.billing.reads import BillingReads

    detail = _found(obj.operator.show(event_id), f"no event {event_id}")
    detail["domain_rows"] = BillingReads(obj.pool).rows_written_by([event_id, *detail["snapshot_twins"]])
    if as_json:
        _echo_json(detail)
        return
    for key, value in detail["event"].items():
        click.echo(f"{key:18} {'' if value is None else _plain(value)}")
    click.echo(f"{'last delivered':18} {_plain(detail['deliveries']['last_delivered_at'])}")
    if detail["snapshot_twins"]:
        click.echo(f"{'applied as':18} {', '.join(detail['snapshot_twins'])} (its snapshot twin)")
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
    from ledger.event_query import EventQuery

    if bool(event_ids) == bool(bulk_status):
        raise click.UsageError("name event ids, or select them with --status (not both)")
    if bulk_status == EventStatus.PROCESSED and not force:
        raise click.UsageError("replaying processed events needs --force")
    bulk = bool(bulk_status)
    if bulk:
        ids = list(obj.operator.ids_for_replay(EventQuery(status=bulk_status, type_glob=type_glob,
                                                          since=_when(since), until=_when(until), reason=reason)))
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

    actor = _actor()
    waker = obj.waker()
    with click.progressbar(ids, label="replaying", file=sys.stderr,
                           hidden=len(ids) < 100 or as_json) as bar:
        replayed, skipped = obj.operator.replay_paced(bar, actor=actor, reason=why, force=force, rate_per_s=rate,
                                                      wake=waker.wake)
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
    from workers.runtime import sweep_process

    if loop:
        sweep_process(obj.settings, operator=obj.operator, outbox=obj.outbox).run_forever()
        return
    result = sweep_process(obj.settings).run_once()
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
    """Drop payloads of processed events past retention. Unprocessed events are never touched.

    For a ledger without an archive only: with LEDGER_ARCHIVE_URL set, retention archives whole events,
    bodies included, then removes them (ledgerctl retention), and a pruned body would be lost to the archive.
    """
    if obj.settings.archive_url:
        raise click.UsageError("LEDGER_ARCHIVE_URL is set: retention archives and removes whole events "
                               "(ledgerctl retention run); prune would drop bodies the archive should keep")
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


