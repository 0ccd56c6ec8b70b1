"""ledgerctl reproject: rebuild billing from the ledger into a shadow copy, compare, switch in, undo
(workers/reproject.py, docs/reprojection.md); ``reproject --object ID | --customer ID``: repair one
object's or customer's rows from its events, written as rows (workers/object_repair.py).

Exit codes: 0 done; 1 nothing could be done (nothing built to apply, nothing applied to undo, no event
to rebuild, --strict with events not rebuilt, an object not in the ledger): nothing was changed; 2 bad
usage (an unknown table, an id of the wrong shape); 4 another process is working on a rebuild, or
workers held the repaired objects longer than a repair waits.
"""
from __future__ import annotations

import sys
import time
from datetime import datetime, timezone

import click

from ops.cli.base import _Context, _actor, _echo_json, _found, _plain, _table, cli, json_option

ANOTHER_RUNNER = 4
BAR_WIDTH = 30


def _reprojection(obj: _Context, progress=None, parts: int | None = None, slice_size: int | None = None):
    from ledger.reprojection import ReprojectionLedger
    from workers.registry import load_handlers
    from workers.reproject import PARTS, SLICE, Reprojection

    return Reprojection(ReprojectionLedger(obj.settings, obj.pool), load_handlers(obj.settings), progress=progress,
                        parts=parts or PARTS, slice_size=slice_size or SLICE)


slice_option = click.option("--slice-size", type=click.IntRange(1, 100000), default=None,
                            help="Events per transaction (default 2000).")


def _refused(exc) -> None:
    from ledger.reprojection import ReprojectionBusy

    click.echo(f"error: {exc}", err=True)
    sys.exit(ANOTHER_RUNNER if isinstance(exc, ReprojectionBusy) else 1)


def _terminal_progress():
    """A progress bar on a terminal, nothing when the output is a pipe or a file."""
    if not sys.stderr.isatty():
        return None
    shown = {"at": 0.0}

    def progress(phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - shown["at"] < 0.2 and done < total:
            return
        shown["at"] = now
        click.echo(f"\r{phase:9} {_bar(done, total)} {done:,}/{total:,}", err=True, nl=False)
    return progress


def _bar(done: int, total: int) -> str:
    filled = int(BAR_WIDTH * done / total) if total else BAR_WIDTH
    return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"


def _rate(run: dict) -> tuple[float | None, float | None]:
    """Events per second of the main pass so far, and the seconds it still needs at that rate."""
    if run["state"] != "building" or not run["done"]:
        return None, None
    elapsed = (datetime.now(timezone.utc) - run["started_at"]).total_seconds()
    rate = run["done"] / elapsed if elapsed > 0 else None
    return rate, ((run["total"] - run["done"]) / rate if rate else None)


def _summary(run: dict) -> str:
    return (f"rebuild {run['id']} {run['state']}: {run['done']:,}/{run['total']:,} events, "
            f"{run['caught_up']:,} caught up" + (f", lock held {run['lock_ms']:.0f} ms" if run["lock_ms"] else ""))


@cli.group(invoke_without_command=True)
@click.option("--object", "object_id", metavar="ID", help="Repair this object's rows (cus_, sub_, in_, ...).")
@click.option("--customer", metavar="ID", help="Repair this customer's rows and those of its subscriptions, "
              "invoices and checkout sessions.")
@click.option("--dry-run", is_flag=True, help="Show the repair's diff; write nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
def reproject(ctx: click.Context, object_id: str | None, customer: str | None, dry_run: bool, yes: bool,
              as_json: bool):
    """Rebuild billing from the ledger's payloads into a shadow copy; diff, apply, undo. With --object or
    --customer: repair just those rows from their events (shown, then written as rows, audited)."""
    scoped = object_id is not None or customer is not None
    if ctx.invoked_subcommand is not None:
        if scoped or dry_run or yes or as_json:
            raise click.UsageError("--object, --customer, --dry-run and --yes come without a subcommand")
        return
    if not scoped:
        click.echo(ctx.get_help())
        return
    if object_id is not None and customer is not None:
        raise click.UsageError("--object or --customer, not both")
    _repair(ctx.obj, "object" if object_id is not None else "customer",
            object_id if object_id is not None else customer, dry_run=dry_run, yes=yes, as_json=as_json)


def _repair(obj: _Context, scope: str, value: str, *, dry_run: bool, yes: bool, as_json: bool) -> None:
    from ledger.inputs import InputError
    from workers.object_repair import ObjectRepair, RepairBusy, scope_of
    from workers.registry import load_handlers

    try:
        scope, object_id = scope_of(scope, value)
    except InputError as exc:
        raise click.BadParameter(str(exc), param_hint=f"--{scope}") from None
    repair = ObjectRepair(obj.pool, load_handlers(obj.settings))
    plan = _found(repair.diff(scope, object_id), f"{object_id} is not in the ledger")
    if not as_json:
        _show_repair(plan)
    if dry_run or not sum(plan["counts"][k] for k in ("changed", "only_rebuilt", "only_live")):
        if as_json:
            _echo_json(plan)
        return
    if not yes:
        click.confirm(f"Write these rows of {object_id}?", abort=True)
    try:
        done = _found(repair.apply(scope, object_id, actor=_actor()), f"{object_id} is not in the ledger")
    except RepairBusy as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(ANOTHER_RUNNER)
    if as_json:
        _echo_json(done)
    else:
        click.echo(f"repair {done['repair_id']}: {done['written']['written']} row(s) written, "
                   f"{done['written']['removed']} removed, {done['counts']['kept']} kept")


def _show_repair(plan: dict) -> None:
    counts = plan["counts"]
    click.echo(f"{plan['scope']} {plan['object_id']}: rebuilt from {plan['rebuilt_from']} processed event(s); "
               f"{counts['changed']} changed, {counts['only_rebuilt']} only rebuilt, {counts['only_live']} only "
               f"live, {counts['kept']} kept")
    for table in plan["tables"]:
        for row in table["rows"]:
            key = ", ".join(f"{k}={v}" for k, v in row["key"].items())
            if row["kind"] == "changed":
                change = "; ".join(f"{c}: {_plain(row['live'].get(c))!r} -> {_plain(row['rebuilt'].get(c))!r}"
                                   for c in row["differs"])
            elif row["kind"] == "kept":
                change = "written by something its events do not show: kept"
            else:
                change = ""
            click.echo(f"{table['table']} {row['kind']:12} {key}" + (f"  {change}" if change else ""))
    for line in plan["not_in_scope"]:
        click.echo(f"note: {line}")


@reproject.command("start")
@slice_option
@click.option("--parts", type=click.IntRange(1, 64), default=None,
              help="Processes for the main pass, each taking the events of its share of customers (default 1: more help only where cores are spare).")
@json_option
@click.pass_obj
def reproject_start(obj: _Context, slice_size: int | None, parts: int | None, as_json: bool):
    """Rebuild every billing table from every processed event (runs until built; killed, `resume` goes on)."""
    from ledger.reprojection import ReprojectionError

    try:
        run = _reprojection(obj, _terminal_progress(), parts, slice_size).start(actor=_actor())
    except ReprojectionError as exc:
        _refused(exc)
    _done(run, as_json)


@reproject.command("resume")
@slice_option
@json_option
@click.pass_obj
def reproject_resume(obj: _Context, slice_size: int | None, as_json: bool):
    """Go on with a rebuild whose process stopped while building."""
    from ledger.reprojection import ReprojectionError

    try:
        run = _reprojection(obj, _terminal_progress(), slice_size=slice_size).resume()
    except ReprojectionError as exc:
        _refused(exc)
    _done(run, as_json)


def _done(run: dict, as_json: bool) -> None:
    if sys.stderr.isatty():
        click.echo("", err=True)
    if as_json:
        _echo_json(run)
    else:
        click.echo(_summary(run))


@reproject.command("status")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(0, 10000),
              help="How many events not rebuilt to list.")
@json_option
@click.pass_obj
def reproject_status(obj: _Context, limit: int, as_json: bool):
    """The latest rebuild: its state, progress (done/total, events/s, ETA), the events it could not rebuild
    and the handlers it does not run."""
    reprojection = _reprojection(obj)
    run = reprojection.ledger.latest()
    not_run = reprojection.handlers_not_run()
    if run is None:
        if as_json:
            _echo_json({"run": None, "handlers_not_rebuilt": not_run})
        else:
            click.echo("no rebuild yet")
        sys.exit(1)
    rate, eta = _rate(run)
    skips = reprojection.ledger.skips(run["id"], limit)
    counts = reprojection.ledger.skip_counts(run["id"])
    if as_json:
        _echo_json({"run": run, "events_per_s": rate, "eta_s": eta, "not_rebuilt": counts, "not_rebuilt_events": skips,
                    "handlers_not_rebuilt": not_run, "audit": reprojection.ledger.audit_of(run["id"])})
        return
    click.echo(_summary(run))
    click.echo(f"{_bar(run['done'], run['total'])} {run['done']:,}/{run['total']:,}"
               + (f"  {rate:,.0f} events/s, about {eta:,.0f} s to go" if rate else ""))
    click.echo(f"{sum(counts.values())} event(s) not rebuilt" + (f": {counts}" if counts else ""))
    if skips:
        _table(skips, ["event_id", "event_type", "reason", "detail"])
    for entry in not_run:
        click.echo(f"not re-projected: {entry['module']}.{entry['handler']} ({entry['pattern']})")


@reproject.command("diff")
@click.option("--table", "tables", multiple=True, help="Only this table (repeatable).")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(0, 100000),
              help="Rows listed per table.")
@json_option
@click.pass_obj
def reproject_diff(obj: _Context, tables: tuple[str, ...], limit: int, as_json: bool):
    """Per table, live against rebuilt: rows only live, only rebuilt, changed (which columns, old -> new), and
    the live rows kept through an apply (their source is an event the rebuild could not apply)."""
    from ledger.reprojection import ReprojectionError, UnknownTable

    reprojection = _reprojection(obj)
    try:
        run, diffs = reprojection.diff(limit=limit, tables=list(tables) or None)
    except UnknownTable as exc:
        raise click.BadParameter(str(exc), param_hint="--table") from None
    except ReprojectionError as exc:
        _refused(exc)
    skips = reprojection.ledger.skips(run["id"], 1000)
    if as_json:
        _echo_json({"run": run["id"], "tables": [{"table": d.table, "key": d.key, **d.counts(), "rows": d.rows}
                                                 for d in diffs], "not_rebuilt": skips})
        return
    _table([{"table": d.table, **d.counts()} for d in diffs], ["table", "only_live", "only_rebuilt", "changed", "kept"])
    for d in diffs:
        for row in d.rows:
            key = ", ".join(f"{k}={v}" for k, v in row["key"].items())
            change = "; ".join(f"{c}: {old!r} -> {new!r}" for c, (old, new) in row.get("columns", {}).items())
            if row["kind"] == "kept":
                change = f"written by {row['source'] or 'no event'}, which this rebuild could not apply"
            click.echo(f"{d.table} {row['kind']:12} {key}" + (f"  {change}" if change else ""))
    if skips:
        click.echo(f"{len(skips)} event(s) not rebuilt (`ledgerctl reproject status` lists them)")


@reproject.command("apply")
@click.option("--strict", is_flag=True, help="Refuse while any event could not be rebuilt.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_obj
def reproject_apply(obj: _Context, strict: bool, yes: bool, as_json: bool):
    """Switch the rebuilt tables in (the live ones are kept for `undo`)."""
    if not yes:
        click.confirm("Switch the rebuilt billing tables in?", abort=True)
    _act(obj, lambda r: r.apply(actor=_actor(), strict=strict), as_json)


@reproject.command("undo")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_obj
def reproject_undo(obj: _Context, yes: bool, as_json: bool):
    """Switch back the tables the last apply replaced (with the events processed since applied to them)."""
    if not yes:
        click.confirm("Switch the billing tables from before the apply back in?", abort=True)
    _act(obj, lambda r: r.undo(actor=_actor()), as_json)


@reproject.command("cancel")
@json_option
@click.pass_obj
def reproject_cancel(obj: _Context, as_json: bool):
    """Drop a rebuild that is building or built."""
    _act(obj, lambda r: r.cancel(actor=_actor()), as_json)


@reproject.command("discard")
@json_option
@click.pass_obj
def reproject_discard(obj: _Context, as_json: bool):
    """Drop the tables the last apply replaced: no undo after this."""
    _act(obj, lambda r: r.discard(actor=_actor()), as_json)


def _act(obj: _Context, action, as_json: bool) -> None:
    """One state change of the open rebuild; its run after, or the refusal (nothing changed)."""
    from ledger.reprojection import ReprojectionError

    try:
        run = action(_reprojection(obj))
    except ReprojectionError as exc:
        _refused(exc)
    _echo_json(run) if as_json else click.echo(_summary(run))
