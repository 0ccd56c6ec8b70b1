"""Running one named statement: how every ledger class (EventStore, WorkerLedger,
OperatorLedger, OutboxLedger) talks to Postgres outside a transaction of its own.

The retry rule, the only one: after a Postgres restart every idle pooled
connection is dead, and the first statement on one fails before reaching the
server. Checking each connection before use would cost a round trip per
statement; instead, a statement whose connection turned out broken makes the
pool check its idle connections and runs once more, on a fresh one. So a
restart costs no worker a failed claim or a failure it could not record, no
dispatcher a delivery, no ledgerctl command an error.

Nothing else is retried. A statement timeout (SQLSTATE 57014) leaves the
connection usable and has already cost its whole timeout: running it again
would double the wait (for the receiver, the time before Stripe gets its 503).
Any other error is the statement's own. And only once: a second broken
connection is Postgres being down, and is raised.
"""
from __future__ import annotations

from typing import Any, Mapping

import psycopg
from psycopg.rows import RowFactory, dict_row

from ledger.db import ProcessPool


def run_statement(pool: ProcessPool, sql: str, params: Mapping[str, Any] | None = None, *,
                  row_factory: RowFactory = dict_row) -> list:
    """Run one autocommitted statement; its rows (none for a statement that returns none), as dicts unless
    ``row_factory`` says otherwise (``tuple_row`` for many rows read in bulk)."""
    connections = pool.get()
    for last_try in (False, True):
        with connections.connection() as conn:
            try:
                cursor = conn.cursor(row_factory=row_factory).execute(sql, params or {})
                return cursor.fetchall() if cursor.description else []
            except psycopg.OperationalError:
                if last_try or not conn.broken:
                    raise
        # The broken connection went back to the pool, which discards it; the check
        # discards every other dead idle one, so the second try gets a live connection.
        connections.check()
    raise AssertionError("unreachable")
