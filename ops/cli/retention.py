"""ledgerctl retention, archive and partitions: run retention, see its runs, hold events past their
window; list, verify and restore archived months; see, make and migrate to the ledger's monthly
partitions (docs/retention.md)."""
from __future__ import annotations

import dataclasses
import sys

import click

from ledger import inputs
from ledger.archive import ArchiveError, archive_key_is_valid
from ops.cli.base import _Context, _actor, _echo_json, _table, cli, json_option

# Exit codes: 0 done, 1 a run or a file failed, 2 usage or configuration, 4 another runner holds the lock
# (as catch-up's 4: another is running).
ANOTHER_RUNNER = 4


def _stripe_id(value: str, prefix: str, option: str) -> None:
    try:
        inputs.text(option, value)
    except inputs.InputError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None
    if not value.startswith(prefix) or len(value) == len(prefix):
        raise click.BadParameter(f"expected an id like {prefix}123", param_hint=option)


def _archive_key(value: str) -> str:
    if not archive_key_is_valid(value):
        raise click.BadParameter("expected a key as archive list shows it, like events/2026-01/run-00000001.jsonl.gz",
                                 param_hint="KEY")
    return value


def _with_store(obj: _Context):
    runner = obj.retention
    if runner.store is None:
        raise click.UsageError("LEDGER_ARCHIVE_URL is not set: nothing leaves the ledger without an archive")
    return runner


def _archive_failed(exc: ArchiveError):
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


@cli.group()
def retention():
    """Final events past their window leave the ledger, archived first."""


@retention.command("run")
@json_option
@click.pass_obj
def retention_run(obj: _Context, as_json: bool):
    """One retention run now (the sweep runs one every LEDGER_RETENTION_INTERVAL_S)."""
    runner = _with_store(obj)
    report = runner.run()
    if as_json:
        _echo_json(dataclasses.asdict(report))
    elif report.status == "skipped":
        click.echo("another retention run holds the lock; nothing done", err=True)
    else:
        click.echo(f"run {report.run_id} {report.status}: {report.archived} archived in {len(report.files)} "
                   f"file(s), {report.removed} removed, {report.changed} changed since archived (kept), "
                   f"{report.kept_by_hold} kept by a hold, {report.seconds:.1f} s")
        if report.partitions_dropped or report.months_deferred:
            click.echo(f"months past the window: {report.partitions_dropped} replaced by what they keep "
                       f"({report.kept_in_month} events), longest swap {report.longest_drop_s * 1000:.0f} ms; "
                       f"{report.months_deferred} left for the next run (the ledger's tables stayed locked)")
        if report.error:
            click.echo(f"error: {report.error}", err=True)
    sys.exit({"done": 0, "skipped": ANOTHER_RUNNER}.get(report.status, 1))


@retention.command("status")
@click.option("--limit", default=10, show_default=True, type=click.IntRange(1, 1000))
@json_option
@click.pass_obj
def retention_status(obj: _Context, limit: int, as_json: bool):
    """The policy, the latest runs and the holds in force."""
    runner = obj.retention
    policy = runner.policy
    runs, holds = runner.recent_runs(limit), runner.holds()
    if as_json:
        _echo_json({"processed_days": policy.processed_days, "failed_days": policy.failed_days,
                    "archive": runner.store.url if runner.store else None, "runs": runs, "holds": holds})
        return
    click.echo(f"processed events kept {policy.processed_days} days, failed_permanent {policy.failed_days} days; "
               f"archive: {runner.store.url if runner.store else 'none (LEDGER_ARCHIVE_URL unset: nothing leaves)'}")
    _table(runs, ["id", "status", "archived", "removed", "changed", "kept_by_hold", "files", "partitions_dropped",
                  "seconds", "started_at", "runner", "error"])
    click.echo(f"{len(holds)} hold(s) in force")


@retention.command("hold")
@click.option("--event", "event_id", help="Hold one event (evt_...).")
@click.option("--customer", "customer_id", help="Hold every event about a customer (cus_...).")
@click.option("--reason", required=True, help="Why (kept with the hold).")
@click.pass_obj
def retention_hold(obj: _Context, event_id: str | None, customer_id: str | None, reason: str):
    """Keep matching events in the ledger past every window, until the hold is released."""
    if (event_id is None) == (customer_id is None):
        raise click.UsageError("give exactly one of --event and --customer")
    if event_id is not None:
        _stripe_id(event_id, "evt_", "--event")
    if customer_id is not None:
        _stripe_id(customer_id, "cus_", "--customer")
    try:
        reason = inputs.text("--reason", reason, limit=1000)
    except inputs.InputError as exc:
        raise click.BadParameter(str(exc), param_hint="--reason") from None
    if not reason.strip():
        raise click.BadParameter("a hold needs a reason", param_hint="--reason")
    hold_id = obj.retention.hold(event_id=event_id, customer_id=customer_id, reason=reason.strip(), actor=_actor())
    click.echo(f"hold {hold_id} in force")


@retention.command("holds")
@json_option
@click.pass_obj
def retention_holds(obj: _Context, as_json: bool):
    """The holds in force."""
    holds = obj.retention.holds()
    if as_json:
        _echo_json(holds)
    else:
        _table(holds, ["id", "event_id", "customer_id", "reason", "actor", "created_at"])


@retention.command("release")
@click.argument("hold_id", type=click.IntRange(1))
@click.pass_obj
def retention_release(obj: _Context, hold_id: int):
    """End a hold: its events leave with the next run once past their window."""
    if not obj.retention.release(hold_id, actor=_actor()):
        click.echo(f"no hold {hold_id} in force", err=True)
        sys.exit(1)
    click.echo(f"hold {hold_id} released")


@cli.group()
def archive():
    """The archive of events retention removed: list, verify, restore."""


@archive.command("list")
@json_option
@click.pass_obj
def archive_list(obj: _Context, as_json: bool):
    """Every archived file the store holds (its manifests), with what the ledger recorded of it."""
    runner = _with_store(obj)
    try:
        manifests = runner.store.manifests()
    except ArchiveError as exc:
        _archive_failed(exc)
    known = {row["key"]: row for row in runner.catalogued_files()}
    rows = [{**dataclasses.asdict(m), "removed": known.get(m.key, {}).get("removed"),
             "restored_at": known.get(m.key, {}).get("restored_at")} for m in manifests]
    if as_json:
        _echo_json(rows)
    else:
        _table(rows, ["key", "month", "events", "bytes", "removed", "restored_at", "sha256"])


@archive.command("verify")
@click.argument("key")
@click.pass_obj
def archive_verify(obj: _Context, key: str):
    """Read a file back and check it against its manifest (checksum, size, events)."""
    _archive_key(key)
    try:
        manifest = _with_store(obj).verify(key)
    except ArchiveError as exc:
        _archive_failed(exc)
    click.echo(f"{key}: {manifest.events} events, sha256 {manifest.sha256}: ok")


@archive.command("restore")
@click.argument("key")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_obj
def archive_restore(obj: _Context, key: str, yes: bool):
    """Put an archived file's events back into the ledger, with every row that named them. An event the
    ledger has again is left as it is. Restored events keep their status: nothing is processed again."""
    _archive_key(key)
    if not yes:
        click.confirm(f"restore {key} into the ledger?", abort=True)
    try:
        written, present = _with_store(obj).restore(key)
    except ArchiveError as exc:
        _archive_failed(exc)
    click.echo(f"{key}: {written} events restored, {present} already in the ledger")


@cli.group(invoke_without_command=True)
@json_option
@click.pass_context
def partitions(ctx: click.Context, as_json: bool):
    """The ledger's monthly partitions: which months exist, how many are ready ahead, strays."""
    if ctx.invoked_subcommand is not None:
        return
    from ledger.partitions import Partitions

    upkeep = Partitions(ctx.obj.pool)
    health, listed = upkeep.health(), upkeep.listed()
    if as_json:
        _echo_json({**dataclasses.asdict(health), "partitions": listed})
        return
    if not health.partitioned:
        click.echo("ledger.events is not partitioned: ledgerctl partitions migrate partitions it, online "
                   "(docs/retention.md, \"Partitions\")")
        return
    _table(listed, ["name", "starts", "ends", "is_default"])
    click.echo(f"months ready after this one: {health.months_ahead}; events outside every planned month: "
               f"{health.strays}")


@partitions.command("ensure")
@click.option("--ahead", type=click.IntRange(0, 36), default=None,
              help="Months after the current one to make (default: what the sweep makes).")
@click.pass_obj
def partitions_ensure(obj: _Context, ahead: int | None):
    """Make this month's partitions and the months ahead now (the sweep does it every hour)."""
    from ledger.partitions import AHEAD, Partitions

    upkeep = Partitions(obj.pool)
    if not upkeep.health().partitioned:
        click.echo("ledger.events is not partitioned: nothing to make (ledgerctl partitions migrate partitions it)")
        return
    made = upkeep.ensure(AHEAD if ahead is None else ahead)
    click.echo("made: " + ", ".join(made) if made else "nothing to make: every month is there")


@partitions.command("migrate")
@click.option("--abort", is_flag=True, help="Give up a migration before its swap: the tables stay as they were.")
@json_option
@click.pass_obj
def partitions_migrate(obj: _Context, abort: bool, as_json: bool):
    """Partition a ledger that had events before migration 0012, online: the receiver and the workers keep
    running; their writes wait only for the final swap (docs/retention.md, "Moving an existing ledger").
    Run again after an interruption: it resumes. Exits 4 while another process runs it."""
    from ledger.errors import MigrationError
    from ledger.partition_migration import AnotherMigration, PartitionMigration

    def progress(phase: str, done: int) -> None:
        if not as_json and done % 100_000 < 5_000:
            click.echo(f"{phase}: {done} copied", err=True)
    migration = PartitionMigration(obj.pool, progress=progress)
    try:
        report = migration.abort() if abort else migration.run()
    except AnotherMigration as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(ANOTHER_RUNNER)
    except MigrationError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    if as_json:
        _echo_json(dataclasses.asdict(report))
    elif report.status == "already":
        click.echo("ledger.events is partitioned already: nothing to do")
    elif report.status == "aborted":
        click.echo("aborted: the partitioned copies and the triggers are gone; the tables are as they were")
    else:
        click.echo(f"done in {report.seconds:.1f} s: {report.events} events, {report.attempts} attempts, "
                   f"{report.deliveries} deliveries copied; the swap held the tables for "
                   f"{report.swap_s * 1000:.0f} ms; {report.gave_way} batches gave way to writers, "
                   f"{report.lock_waits} lock waits given up")
