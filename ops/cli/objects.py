"""ledgerctl objects show: any Stripe id's story (workers/object_view.py). An event id opens the
event (``events show``); any other id, the object: its events in Stripe's order, its rows live
beside rebuilt (and Stripe's, with --stripe), the columns that differ marked, and its links."""
from __future__ import annotations

import json

import click

from ops.cli.base import _Context, _echo_json, _found, _plain, _table, cli, json_option
from ops.cli.events import events_show


@cli.group()
def objects():
    """One Stripe object, by its id."""


@objects.command("show")
@click.argument("object_id")
@click.option("--stripe", "fetch", is_flag=True,
              help="Also fetch the object from Stripe's API now (STRIPE_API_KEY) and show its rows beside.")
@json_option
@click.pass_context
def objects_show(ctx: click.Context, object_id: str, fetch: bool, as_json: bool):
    """An object's events, its rows live | rebuilt [| Stripe], and the objects it is linked to.

    Rebuilt: what today's handlers make of the ledger's events of it, in memory. live ≠ rebuilt:
    the row is not what the handlers write now (a handler bug since fixed, or a hand edit);
    live = rebuilt ≠ Stripe: an event the ledger never received (ledgerctl catchup or backfill).
    """
    from workers.object_view import ObjectView, object_id as checked
    from workers.registry import load_handlers

    object_id = checked(object_id)
    if object_id.startswith("evt_"):
        ctx.invoke(events_show, event_id=object_id, as_json=as_json)
        return
    obj: _Context = ctx.obj
    view = ObjectView(obj.pool, load_handlers(obj.settings), stripe_api=obj.stripe_api)
    story = _found(view.show(object_id, stripe=fetch), f"{object_id} is not in the ledger")
    if as_json:
        _echo_json(story)
        return
    click.echo(f"{story['id']}  ({story['object'] or 'type unknown'})")
    for name, ids in story["links"].items():
        click.echo(f"  {name}: {', '.join(ids)}")
    click.echo(f"\nevents ({len(story['events'])}, in Stripe's order)")
    _table(story["events"], ["stripe_created", "id", "type", "status", "attempts", "deliveries", "replays",
                             "api_version", "failure_reason"])
    if story["stripe"] is not None and story["stripe"]["error"]:
        click.echo(f"\nStripe: the fetch failed: {story['stripe']['error']}")
    for table in story["tables"]:
        click.echo(f"\n{table['table']}")
        for row in table["rows"]:
            key = ", ".join(f"{k}={v}" for k, v in row["key"].items())
            mark = f"differs in: {', '.join(row['differs'])}" if row["differs"] else "same"
            click.echo(f"  {key}  ({mark})")
            for side in ("live", "rebuilt", "stripe"):
                if side in row:
                    click.echo(f"    {side:8} {_shown(row[side], row['differs'])}")


def _shown(row: dict | None, differs: list[str]) -> str:
    if row is None:
        return "(no row)"
    cells = [f"{'*' if c in differs else ''}{c}={json.dumps(_plain(v), default=str)}" for c, v in row.items()]
    return " ".join(cells)
