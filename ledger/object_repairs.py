"""What a repair scoped to one object or customer reads and records in the ledger (ledger/sql/repairs.sql).

The repair itself (workers/object_repair.py) runs in one transaction on a connection it holds: the
objects' locks first (WorkerLedger.lock_objects, as a worker's batch takes them), then the events
read and the audit recorded on that same connection, so the
events it rebuilds from are every one a worker has committed, and none a worker commits until the
repair does.
"""
from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from ledger import jsoncodec
from ledger.db import ProcessPool
from ledger.queries import SQL
from ledger.statements import run_statement


class RepairLedger:
    def __init__(self, pool: ProcessPool):
        self._pool = pool

    @staticmethod
    def events(conn: psycopg.Connection, object_id: str) -> list[dict[str, Any]]:
        """The object's events (and a customer's, its other objects'), read in the repair's transaction."""
        return conn.cursor(row_factory=dict_row).execute(SQL.object_events, {"id": object_id}).fetchall()

    @staticmethod
    def record(conn: psycopg.Connection, *, scope: str, object_id: str, actor: str, counts: dict[str, int],
               changes: list[dict[str, Any]]) -> dict[str, Any]:
        """The audit row, in the repair's transaction (object_repair_record)."""
        dumps = lambda value: Jsonb(value, dumps=jsoncodec.dumps)  # noqa: E731
        return conn.cursor(row_factory=dict_row).execute(SQL.object_repair_record, {
            "scope": scope, "object_id": object_id, "actor": actor, "counts": dumps(counts),
            "changes": dumps(changes)}).fetchone()

    def history(self, object_id: str, *, limit: int = 20) -> list[dict[str, Any]]:
        """The object's repairs, newest first (object_repairs_of)."""
        return run_statement(self._pool, SQL.object_repairs_of, {"object_id": object_id, "limit": limit})
