"""Re-projection's side of the ledger: its runs and their states, the shadow schema, the events a
rebuild reads, the diff and the switch. The rebuild itself (the handlers, run on the shadow) is
workers/reproject.py; the statements are ledger/sql/reprojection.sql, the shadow's DDL and the
switch migration 0015's functions.

A run's states: building -> built -> applied -> undone | discarded, and building | built ->
cancelled. The shadow is schema ``billing_rebuild``; the tables an apply replaced are kept in
``billing_before`` for ``undo`` until the next rebuild or a discard.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterator

import psycopg
from psycopg import sql as pgsql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from ledger import jsoncodec
from ledger.config import Settings
from ledger.db import ProcessPool, session_lock
from ledger.errors import LedgerError
from ledger.queries import SQL
from ledger.statements import run_statement

SHADOW = "billing_rebuild"
BEFORE = "billing_before"
OPEN_STATES = ("building", "built", "applied")
# How long the switch waits for each live table's lock before it lets go and tries again.
SWITCH_LOCK_WAIT_MS = 500


class ReprojectionError(LedgerError):
    """A rebuild command that cannot go ahead: nothing was changed. Its message says why."""


class UnknownTable(ReprojectionError):
    """A table the rebuild did not make was asked for (a usage error)."""


class ReprojectionBusy(ReprojectionError):
    """Another process works on a rebuild (it holds the rebuild's advisory lock)."""


@dataclass(frozen=True)
class StoredEvent:
    """A processed event as a rebuild reads it back from the ledger; for a thin notification, what the
    worker applied for it (migration 0016), when the ledger kept it."""
    id: str
    type: str
    payload: dict | None
    created: datetime
    livemode: bool
    account: str | None
    api_version: str | None
    applied_object: dict | None = None
    applied_api_version: str | None = None
    applied_as: str | None = None

    @classmethod
    def from_row(cls, row: dict) -> "StoredEvent":
        return cls(row["id"], row["type"], row["payload"], row["stripe_created"], row["livemode"], row["account"],
                   row["api_version"], row.get("applied_object"), row.get("applied_api_version"),
                   row.get("applied_as"))


@dataclass
class TableDiff:
    """One table, live against rebuilt: the counts, and up to the diff's limit of rows."""
    table: str
    key: list[str]
    only_live: int = 0
    only_rebuilt: int = 0
    changed: int = 0
    # Live rows whose source the rebuild could not apply: merged into the rebuilt table, so an apply keeps them.
    kept: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.only_live + self.only_rebuilt + self.changed + self.kept

    def counts(self) -> dict[str, int]:
        return {"only_live": self.only_live, "only_rebuilt": self.only_rebuilt, "changed": self.changed,
                "kept": self.kept}


_KEY_NAME = re.compile(r"^[a-z_][a-z0-9_]*$|\(([a-z_][a-z0-9_]*)")


def _key_name(expression: str) -> str:
    """A key expression's column: itself (``id``), or the first inside a function (``COALESCE(account, ...)``)."""
    match = _KEY_NAME.search(expression)
    return (match.group(1) or match.group(0)) if match else expression


def row_difference(diff_row: dict, key: list[str]) -> dict[str, Any]:
    """A differing row as the diff shows it: its key, whether it is only live, only rebuilt or changed,
    and for a changed one each column that differs, old -> new."""
    live, rebuilt = diff_row["live"], diff_row["rebuilt"]
    either = live if live is not None else rebuilt
    out: dict[str, Any] = {"key": {name: either.get(name) for name in key}}
    if rebuilt is None:
        out["kind"] = "only_live"
    elif live is None:
        out["kind"] = "only_rebuilt"
    else:
        out["kind"] = "changed"
        out["columns"] = {name: [live.get(name), rebuilt.get(name)]
                          for name in sorted(set(live) | set(rebuilt)) if live.get(name) != rebuilt.get(name)}
    return out


def _one(conn: psycopg.Connection, statement, params: dict | None = None) -> dict | None:
    return conn.cursor(row_factory=dict_row).execute(statement, params or {}).fetchone()


def _all(conn: psycopg.Connection, statement, params: dict | None = None) -> list[dict]:
    return conn.cursor(row_factory=dict_row).execute(statement, params or {}).fetchall()


class ReprojectionLedger:
    def __init__(self, settings: Settings, pool: ProcessPool):
        self._settings = settings
        self._pool = pool

    # Runs and their states.

    def open_run(self) -> dict | None:
        rows = run_statement(self._pool, SQL.reprojection_open)
        return rows[0] if rows else None

    def get(self, run_id: int) -> dict | None:
        rows = run_statement(self._pool, SQL.reprojection_get, {"id": run_id})
        return rows[0] if rows else None

    def latest(self) -> dict | None:
        rows = run_statement(self._pool, SQL.reprojection_latest)
        return rows[0] if rows else None

    def skips(self, run_id: int, limit: int = 1000) -> list[dict]:
        return run_statement(self._pool, SQL.reprojection_skips, {"id": run_id, "limit": limit})

    def skip_counts(self, run_id: int) -> dict[str, int]:
        return {row["reason"]: row["events"] for row in run_statement(self._pool, SQL.reprojection_skip_counts,
                                                                       {"id": run_id})}

    def audit_of(self, run_id: int) -> list[dict]:
        return run_statement(self._pool, SQL.reprojection_audit_of, {"id": run_id})

    @contextlib.contextmanager
    def runner_lock(self) -> Iterator[None]:
        """Hold the rebuild's lock for the block; ReprojectionBusy when another process holds it."""
        with session_lock(self._settings, SQL.reprojection_try_lock, SQL.reprojection_unlock,
                          name="ledger-reproject") as held:
            if not held:
                raise ReprojectionBusy("another process is working on a rebuild (it holds the rebuild's lock): "
                                       "nothing was done; `ledgerctl reproject status` shows it")
            yield

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """The rebuild's own session (autocommit; each slice opens its transaction): a long rebuild never
        holds one of the pool's connections, nor a snapshot between its slices. Rows as tuples, as the
        handlers get them on a worker's connection; this class reads its own as dicts (``_one``, ``_all``)."""
        conn = jsoncodec.use(psycopg.connect(self._settings.database_url, autocommit=True,
                                             application_name="ledger-reproject"))
        # The shadow's tables start empty and grow: a plan made for an empty table (a sequential scan) would
        # stay the plan of a prepared statement that reads them.
        conn.execute("SET plan_cache_mode = force_custom_plan")
        try:
            yield conn
        finally:
            conn.close()

    def dependents(self) -> list[str]:
        """Views and foreign keys outside billing that name its tables (a switch would leave them behind)."""
        return run_statement(self._pool, SQL.reprojection_dependents)[0]["dependents"]

    def create(self, conn: psycopg.Connection, *, actor: str, scope: dict, parts: int, tables: list[str]) -> dict:
        """A new rebuild, building: the shadow made from the live tables, the main pass's events queued in
        ``parts`` parts, the first catch-up's start taken before the queue is read. Its ``start`` audited.
        One transaction."""
        with conn.transaction():
            cut = self.catchup_cut(conn)
            tables = _one(conn, SQL.reprojection_make_shadow, {"schema": SHADOW, "tables": tables})["tables"]
            conn.execute(SQL.reprojection_create_queue)
            total = conn.execute(SQL.reprojection_fill_queue, {"parts": parts}).rowcount
            run_id = _one(conn, SQL.reprojection_create, {"scope": Jsonb(scope), "actor": actor, "tables": tables,
                                                          "total": total, "parts": parts, "cut": cut})["id"]
            conn.execute(SQL.reprojection_create_parts, {"id": run_id})
            self.audit(conn, run_id, "start", actor, scope, {"events": total, "parts": parts})
        return self.get(run_id)

    def parts(self, run_id: int) -> list[dict]:
        return run_statement(self._pool, SQL.reprojection_parts, {"id": run_id})

    def catchup_cut(self, conn: psycopg.Connection) -> datetime:
        return _one(conn, SQL.reprojection_catchup_cut)["cut"]

    def queued_events(self, conn: psycopg.Connection, part: int, after: int, size: int) -> list[StoredEvent]:
        return [StoredEvent.from_row(row) for row in
                _all(conn, SQL.reprojection_queued_events, {"part": part, "after": after, "size": size})]

    def processed_since(self, conn: psycopg.Connection, since: datetime) -> list[tuple[str, datetime]]:
        """The keys (id, created) of the events processed at or after ``since``, in Stripe's order."""
        return conn.execute(SQL.reprojection_processed_since, {"since": since}).fetchall()

    def events_by_key(self, conn: psycopg.Connection, keys: list[tuple[str, datetime]]) -> list[StoredEvent]:
        return [StoredEvent.from_row(row) for row in _all(
            conn, SQL.reprojection_events_by_key, {"ids": [k[0] for k in keys], "created": [k[1] for k in keys]})]

    def advance(self, conn: psycopg.Connection, run_id: int, part: int, done: int) -> bool:
        """In a slice's transaction; False when the run is no longer building (cancelled)."""
        return conn.execute(SQL.reprojection_advance, {"id": run_id, "part": part, "done": done}).fetchone() is not None

    def record_catchup(self, conn: psycopg.Connection, run_id: int, state: str, cut: datetime, applied: int) -> bool:
        return conn.execute(SQL.reprojection_record_catchup,
                            {"id": run_id, "state": state, "cut": cut, "applied": applied}).fetchone() is not None

    def create_kept(self, conn: psycopg.Connection) -> None:
        conn.execute(SQL.reprojection_create_kept)

    def record_kept(self, conn: psycopg.Connection, table: str, keys: list[list], sources: list[str | None]) -> None:
        """In the keeping's transaction: these rows of ``table`` (their keys, their sources) are kept."""
        conn.execute(SQL.reprojection_record_kept, {"table": table, "keys": [Jsonb(k) for k in keys],
                                                    "sources": sources})

    def skip(self, conn: psycopg.Connection, run_id: int, event: StoredEvent, reason: str, detail: str | None) -> None:
        conn.execute(SQL.reprojection_skip, {"id": run_id, "event_id": event.id, "event_type": event.type,
                                             "reason": reason, "detail": detail})

    def unskip(self, conn: psycopg.Connection, run_id: int, event_ids: list[str]) -> None:
        conn.execute(SQL.reprojection_unskip, {"id": run_id, "event_ids": event_ids})

    def built(self, conn: psycopg.Connection, run_id: int) -> bool:
        return conn.execute(SQL.reprojection_built, {"id": run_id}).fetchone() is not None

    def cancel(self, run_id: int, actor: str, scope: dict) -> bool:
        with self.connection() as conn, conn.transaction():
            if conn.execute(SQL.reprojection_cancelled, {"id": run_id}).fetchone() is None:
                return False
            self.audit(conn, run_id, "cancel", actor, scope, {})
        return True

    def discard(self, run_id: int, actor: str, scope: dict) -> bool:
        """applied -> discarded, and the tables before it dropped, in one transaction."""
        with self.connection() as conn, conn.transaction():
            if conn.execute(SQL.reprojection_discarded, {"id": run_id}).fetchone() is None:
                return False
            self.audit(conn, run_id, "discard", actor, scope, {})
            self.drop_schema(conn, BEFORE)
        return True

    def drop_schema(self, conn: psycopg.Connection, schema: str) -> None:
        if schema not in (SHADOW, BEFORE):
            raise ValueError(f"{schema} is not a schema of the rebuild's")
        conn.execute(pgsql.SQL(SQL.reprojection_drop_schema).format(schema=pgsql.Identifier(schema)))

    def audit(self, conn: psycopg.Connection, run_id: int, action: str, actor: str, scope: dict,
              counts: dict) -> None:
        conn.execute(SQL.reprojection_audit, {"id": run_id, "action": action, "actor": actor,
                                              "scope": Jsonb(scope), "counts": Jsonb(counts)})

    # The switch.

    def lock_tables(self, conn: psycopg.Connection, tables: list[str]) -> None:
        """In the switch's transaction: the live tables, each waited for at most SWITCH_LOCK_WAIT_MS
        (psycopg.errors.LockNotAvailable past it: the caller rolls back and tries again)."""
        conn.execute(SQL.lock_timeout, {"lock_ms": SWITCH_LOCK_WAIT_MS})
        conn.execute(pgsql.SQL(SQL.reprojection_lock_tables).format(
            tables=pgsql.SQL(", ").join(pgsql.Identifier("billing", name) for name in tables)))

    def switch(self, conn: psycopg.Connection, *, incoming: str, aside: str, tables: list[str]) -> None:
        conn.execute(SQL.reprojection_switch, {"incoming": incoming, "aside": aside, "tables": tables})

    def applied(self, conn: psycopg.Connection, run_id: int, actor: str) -> bool:
        return conn.execute(SQL.reprojection_applied, {"id": run_id, "actor": actor}).fetchone() is not None

    def undone(self, conn: psycopg.Connection, run_id: int) -> bool:
        return conn.execute(SQL.reprojection_undone, {"id": run_id}).fetchone() is not None

    def lock_held(self, run_id: int, lock_ms: float) -> None:
        run_statement(self._pool, SQL.reprojection_lock_held, {"id": run_id, "lock_ms": lock_ms})

    # The diff.

    def diff(self, tables: list[str], *, limit: int) -> list[TableDiff]:
        """Each table, live against the shadow: counts, and up to ``limit`` differing rows (in key order)."""
        return [self.diff_table(table, limit=limit) for table in tables]

    def diff_table(self, table: str, *, limit: int) -> TableDiff:
        shape = run_statement(self._pool, SQL.reprojection_table_shape, {"table": table})[0]
        keys = shape["key"]
        names = [f"k{n}" for n in range(len(keys))]
        statement = pgsql.SQL(SQL.reprojection_diff).format(
            key=pgsql.SQL(", ").join(pgsql.SQL("{} AS {}").format(pgsql.SQL(expr), pgsql.Identifier(name))
                                     for expr, name in zip(keys, names)),
            join=pgsql.SQL(" AND ").join(pgsql.SQL("l.{0} = s.{0}").format(pgsql.Identifier(name)) for name in names),
            table=pgsql.Identifier(table))
        rows = run_statement(self._pool, statement, {"limit": limit, "written_at": shape["written_at"] or []})
        key = [_key_name(expr) for expr in keys]
        result = TableDiff(table, key, **{k: rows[0][k] for k in ("only_live", "only_rebuilt", "changed")})
        result.rows = [row_difference(row, key) for row in rows if row["live"] is not None or row["rebuilt"] is not None]
        counts = self._kept(SQL.reprojection_kept_counts, {})
        result.kept = next((row["rows"] for row in counts if row["table_name"] == table), 0)
        kept = self._kept(SQL.reprojection_kept_rows, {"table": table, "limit": max(limit, 0)}) if result.kept else []
        result.rows += [{"key": dict(zip(key, row["key"])), "kind": "kept", "source": row["source"]} for row in kept]
        return result

    def _kept(self, statement: str, params: dict) -> list[dict]:
        """What the rebuild kept; nothing for one built before rows were kept (its shadow has no such table)."""
        try:
            return run_statement(self._pool, statement, params)
        except psycopg.errors.UndefinedTable:
            return []
