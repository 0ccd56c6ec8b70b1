"""Reads of the billing tables, for operators: the rows an event wrote (``ledgerctl events show``)
and the local side of ``reconcile``. Named SQL from workers/billing/reads.sql."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from psycopg.rows import dict_row

from ledger.db import ProcessPool
from ledger.queries import load

SQL = load("workers.billing")

TYPED_TABLES = ("customers", "subscriptions", "invoices")
"""The typed tables reconcile compares column by column; every other type is the mirror's."""


class BillingReads:
    def __init__(self, pool: ProcessPool):
        self._pool = pool

    def rows_written_by(self, event_ids: Sequence[str]) -> list[dict[str, Any]]:
        """The rows whose current state these events wrote, as {"table_name", "row_id"}."""
        return self._all(SQL.rows_written_by_events, {"ids": list(event_ids)})

    def typed_rows(self, table: str, *, account: str | None, livemode: bool | None) -> list[dict[str, Any]]:
        """billing.<table>'s rows of one account (None: the platform) and mode (None: both)."""
        if table not in TYPED_TABLES:
            raise ValueError(f"no typed table {table!r}: one of {', '.join(TYPED_TABLES)}")
        return self._all(SQL[f"reconcile_{table}"], {"account": account or "", "livemode": livemode})

    def mirrored_rows(self, object_type: str, *, account: str | None, livemode: bool | None) -> list[dict[str, Any]]:
        """The generic mirror's rows of one object type (obj["object"]), as ``typed_rows``."""
        return self._all(SQL.reconcile_objects,
                         {"object_type": object_type, "account": account or "", "livemode": livemode})

    def _all(self, sql: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        with self._pool.get().connection() as conn:
            return conn.cursor(row_factory=dict_row).execute(sql, params).fetchall()
