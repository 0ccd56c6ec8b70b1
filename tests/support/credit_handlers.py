"""A product's own handlers on the writer API (docs/handlers.md, "Your own tables in a batch, and in a
rebuild"): credits per paid invoice in a table of schema billing, rebuilt with billing's own; and a
raw-SQL handler whose table a rebuild never touches. Load with
``LEDGER_HANDLER_MODULES=tests.support.credit_handlers`` (the tables: ``create_tables``)."""
from __future__ import annotations

from workers.registry import handler
from workers.rows import LATEST, STAMP, Table

CREDITS = Table("billing.credits", LATEST, key=("invoice_id",), columns=("invoice_id", "customer_id", "amount"),
                stamp=STAMP, owner=("account", "livemode"))

TABLES = """
CREATE TABLE IF NOT EXISTS billing.credits (
    invoice_id text PRIMARY KEY, customer_id text, amount bigint NOT NULL, account text, livemode boolean NOT NULL,
    source_event_id text NOT NULL, source_event_created timestamptz NOT NULL);
CREATE TABLE IF NOT EXISTS billing.credit_notes (invoice_id text PRIMARY KEY);
"""


@handler("invoice.paid", requires=["data.object.id", "data.object.amount_paid"], writes=[CREDITS], rebuilt=True)
def grant_credits(ctx):
    invoice = ctx.object
    ctx.rows.upsert(CREDITS, {"invoice_id": invoice["id"], "customer_id": invoice.get("customer"),
                              "amount": invoice["amount_paid"]})


@handler("invoice.paid")
def note_credit(ctx):
    ctx.conn.execute("INSERT INTO billing.credit_notes (invoice_id) VALUES (%s) ON CONFLICT DO NOTHING",
                     (ctx.object["id"],))


def create_tables(kit) -> None:
    kit.execute(TABLES)
