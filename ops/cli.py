"""ledgerctl: the operator's command line."""
from __future__ import annotations

import json
import sys

import click

from ledger.config import Settings
from ledger.errors import ConfigError, LedgerError


class _Context:
    def __init__(self):
        self._settings: Settings | None = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_env()
        return self._settings


@click.group()
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
@click.option("--loop", is_flag=True, help="Run forever, one pass every LEDGER_SWEEP_INTERVAL_S.")
@click.option("--json", "as_json", is_flag=True, help="Print the pass result as JSON.")
@click.pass_obj
def sweep(obj: _Context, loop: bool, as_json: bool):
    """Re-drive overdue wake-ups: lost enqueues, dead workers, due retries.

    Safe to run in several replicas at once.
    """
    from ledger.logs import configure as configure_logging
    from workers.app import make_celery
    from workers.runtime import Runtime

    configure_logging()
    runtime = Runtime(obj.settings, make_celery(obj.settings))
    if loop:
        runtime.sweeper.run_forever()
        return
    result = runtime.sweeper.run_once()
    if as_json:
        click.echo(json.dumps(result.__dict__))
    else:
        click.echo(f"re-drove {result.redriven} event(s); queue depth {result.queue_depth}"
                   + (" (skipped: broker backlog)" if result.skipped_backlog else ""))


@cli.group()
def events():
    """Inspect events."""


@events.command("show")
@click.argument("event_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def events_show(obj: _Context, event_id: str, as_json: bool):
    """Show one event's ledger row."""
    from ledger.db import ProcessPool
    from ledger.store import EventStore

    row = EventStore(ProcessPool(obj.settings, name="ledgerctl")).get_event(event_id)
    if row is None:
        raise click.ClickException(f"no event {event_id}")
    if as_json:
        click.echo(json.dumps(row, default=str, indent=2))
    else:
        for key, value in row.items():
            click.echo(f"{key:18} {value}")


def main():
    try:
        cli(standalone_mode=True)
    except (ConfigError, LedgerError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
