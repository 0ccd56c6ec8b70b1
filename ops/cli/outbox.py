"""ledgerctl outbox: list, show and replay the recorded external effects."""
from __future__ import annotations

import json
import sys

import click

from ledger.states import OutboxStatus
from ops.cli.base import _Context, _echo_json, _found, _plain, _table, _values, cli, json_option


@cli.group()
def outbox():
    """Inspect and replay external effects (the transactional outbox)."""


@outbox.command("list")
@click.option("--status", type=click.Choice(_values(*OutboxStatus)))
@click.option("--effect", "effect_glob", help="Effect name, glob allowed (entitlements.*).")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 100_000))
@json_option
@click.pass_obj
def outbox_list(obj: _Context, status, effect_glob, limit, as_json):
    """List recorded effects, newest first."""
    from ledger.event_query import glob_to_like

    rows = obj.outbox.list(status=status, effect_like=glob_to_like(effect_glob), limit=limit)
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
    row = _found(obj.outbox.get(outbox_id), f"no effect {outbox_id}")
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
    from ledger.event_query import glob_to_like

    if bool(outbox_ids) == bool(bulk_status):
        raise click.UsageError("name effect ids, or select them with --status (not both)")
    if bulk_status == OutboxStatus.SENT and not force:
        raise click.UsageError("re-sending sent effects needs --force")
    ledger = obj.outbox
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


