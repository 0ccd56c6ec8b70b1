"""A repair scoped to one object or one customer: its billing rows rewritten from the ledger's events of it.

What a whole rebuild (workers/reproject.py) does for every table, done for the rows of one object
(``--object``: the rows that name it: a subscription's row and transitions, a customer's row and
entitlements) or of one customer (``--customer``: its own, and those of every subscription, invoice
and checkout session of it). The rows come from the same place as the object page's rebuilt column
(workers/object_view.py): today's rebuilt handlers over the object's processed events, in Stripe's
order, in memory (``object_writer``). Compared with the live rows, each row is:

* **changed** (both sides, columns differ) or **only rebuilt**: written, by an upsert whose order guard
  lets a row of the same event be rewritten (``rowsql.repair``) but never one of a newer event;
* **only live**: removed when its source is one of the events applied (the handlers no longer give it)
  or, in a set table, when its scope was replaced; otherwise **kept** (written by something the events
  cannot show: a backfill's fetch, an event pruned), as a rebuild keeps it.

Rows, not a table swap, in one transaction: first the objects' locks, the ones a worker's batch takes
for the same objects (ledger/sql/objects.sql), then the events read, the rows rebuilt and written, and
the audit row (ledger.object_repairs: who, the counts, each row before and after). A worker applying
an event of the object meanwhile waits for the locks and applies it on the repaired rows; one that
got them first has committed before the events are read, so its event is among them. Nothing is lost
either way (tests/integration/test_object_repair.py). ``diff`` shows the same rows without the locks
or any write.

A repair of one subscription or invoice leaves its customer's derived rows (entitlements) as they are:
they depend on the customer's other subscriptions, which are not rebuilt with it; ``--customer``
repairs them (the result says so).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg

from ledger import inputs
from ledger.attempts import WorkerLedger
from ledger.db import ProcessPool
from ledger.object_repairs import RepairLedger
from ledger.reprojection import StoredEvent
from ledger.states import EventStatus
from workers import rowsql
from workers.billing.tables import CHECKOUT_SESSIONS, INVOICES, SUBSCRIPTIONS
from workers.object_view import HOLDERS, LINKS, live_rows, object_id, side_by_side, stored_form
from workers.handlers import object_keys
from workers.registry import HandlerRegistry
from workers.reproject import object_writer
from workers.rows import SET, Table
from workers.writers import RENDERED, rows_json

SCOPES = ("object", "customer")
# The objects of a customer whose rows a customer's repair takes with its own.
CUSTOMER_OBJECTS = (SUBSCRIPTIONS, INVOICES, CHECKOUT_SESSIONS)
# How long a repair waits for a worker's batch holding one of its objects, before it gives up (RepairBusy).
LOCK_WAIT = "10s"
# A customer whose objects change while the repair waits for their locks (a new subscription) is locked
# again with them; past this many rounds the repair gives up (RepairBusy) rather than chase it.
LOCK_ROUNDS = 3


class RepairBusy(Exception):
    """The objects stayed locked by workers longer than a repair waits: nothing was written; try again."""


@dataclass
class _Plan:
    scope: str
    object_id: str
    ids: set[str]
    events: int
    tables: list[dict[str, Any]] = field(default_factory=list)
    # What a worker's batch locks for the events read (workers.handlers.object_keys), and the objects whose rows
    # are in the plan: the locks the repair holds.
    keys: set[str] = field(default_factory=set)
    # The customers of the objects in the plan: a repair of a subscription names its customer's derived rows.
    customers: set[str] = field(default_factory=set)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(("changed", "only_rebuilt", "only_live", "kept"), 0)
        for table in self.tables:
            for row in table["rows"]:
                counts[row["kind"]] += 1
        return counts

    def shown(self) -> dict[str, Any]:
        return {"scope": self.scope, "object_id": self.object_id, "objects": sorted(self.ids),
                "rebuilt_from": self.events, "counts": self.counts(), "tables": self.tables,
                "not_in_scope": self._not_in_scope()}

    def _not_in_scope(self) -> list[str]:
        return [f"the derived rows of {c} (entitlements) depend on its other subscriptions: "
                f"`ledgerctl reproject --customer {c}` repairs them" for c in sorted(self.customers - self.ids)]


def scope_of(kind: object, value: object) -> tuple[str, str]:
    """A checked scope: its kind and an id of the right shape (InputError: a 4xx, exit 2)."""
    if kind not in SCOPES:
        raise inputs.InputError(f"a repair's scope is one of {', '.join(SCOPES)}")
    checked = object_id(value)
    if checked.startswith("evt_"):
        raise inputs.InputError("a repair takes an object's id, not an event's")
    if kind == "customer" and not checked.startswith("cus_"):
        raise inputs.InputError("--customer takes a customer id (cus_...)")
    return kind, checked


class ObjectRepair:
    def __init__(self, pool: ProcessPool, registry: HandlerRegistry):
        self._pool = pool
        self._registry = registry

    def diff(self, scope: str, object_id: str) -> dict[str, Any] | None:
        """What a repair would do now, without locks or writes; None when the ledger has nothing of it."""
        with self._pool.get().connection() as conn:
            plan = self._plan(conn, scope, object_id)
        return plan.shown() if plan else None

    def apply(self, scope: str, object_id: str, *, actor: str) -> dict[str, Any] | None:
        """The repair, in one transaction (see the module's opening); what it wrote, with the audit row's id.
        None when the ledger has nothing of it; RepairBusy when its objects stayed locked."""
        with self._pool.get().connection() as conn:
            try:
                with conn.transaction():
                    conn.execute(f"SET LOCAL lock_timeout = '{LOCK_WAIT}'")
                    plan = self._locked_plan(conn, scope, object_id)
                    if plan is None:
                        return None
                    written = _write(conn, plan)
                    counts = {**plan.counts(), **written}
                    changes = [{"table": t["table"], "kind": row["kind"], "key": row["key"],
                                "before": row.get("live"), "after": row.get("rebuilt")}
                               for t in plan.tables for row in t["rows"] if row["kind"] != "kept"]
                    audit = RepairLedger.record(conn, scope=scope, object_id=object_id, actor=actor,
                                                counts=counts, changes=changes)
            except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as exc:
                raise RepairBusy(f"{object_id}: its objects are held by workers' batches; nothing was written, "
                                 "try again") from exc
        return {**plan.shown(), "repair_id": audit["id"], "at": audit["at"], "written": written}

    def history(self, object_id: str) -> list[dict[str, Any]]:
        return RepairLedger(self._pool).history(object_id)

    def _locked_plan(self, conn: psycopg.Connection, scope: str, object_id: str) -> _Plan | None:
        """The plan made under the locks of every object it covers: those seen before locking, and any
        that joined meanwhile (locked in a round of their own)."""
        locked: set[str] = set()
        wanted = {object_id}
        for _ in range(LOCK_ROUNDS):
            WorkerLedger.lock_objects(conn, wanted - locked)
            locked |= wanted
            plan = self._plan(conn, scope, object_id)
            if plan is None:
                return None
            wanted = _lock_keys(plan)
            if wanted <= locked:
                return plan
        raise psycopg.errors.LockNotAvailable("the customer's objects kept changing")

    def _plan(self, conn: psycopg.Connection, scope: str, object_id: str) -> _Plan | None:
        found = RepairLedger.events(conn, object_id)
        applied = [StoredEvent.from_row(e) for e in found if e["status"] == EventStatus.PROCESSED.value]
        writer = object_writer(self._registry, applied)
        rebuilt = writer.tables()
        ids = {object_id}
        if scope == "customer":
            for table in CUSTOMER_OBJECTS:
                ids |= {r["id"] for r in rebuilt.get(table.name, []) if r.get("customer_id") == object_id}
            for table, column, _ in LINKS:
                if column == "customer_id":
                    ids |= {r["id"] for r in live_rows(conn, table, column, [object_id])}
        values = sorted(ids)
        sources = {e.id for e in applied} | {e.applied_as for e in applied if e.applied_as}
        plan = _Plan(scope, object_id, ids, len(applied))
        for event in found:
            plan.keys |= object_keys(event["payload"] or {})
            if event["applied_object"]:
                plan.keys |= object_keys({"data": {"object": event["applied_object"]}})
        for table in CUSTOMER_OBJECTS:
            plan.customers |= {r["customer_id"] for r in rebuilt.get(table.name, [])
                               if r.get("id") in ids and r.get("customer_id")}
        any_live = False
        for table, column in HOLDERS:
            live = live_rows(conn, table, column, values)
            any_live = any_live or bool(live)
            mine = stored_form(conn, table, [r for r in rebuilt.get(table.name, []) if r.get(column) in ids])
            replaced = writer.replaced.get(table, set())
            rows = [_classified(table, row, sources, replaced)
                    for row in side_by_side(table, {"live": live, "rebuilt": mine})
                    if row["differs"]]
            if rows:
                plan.tables.append({"table": table.name, "key": list(table.key), "rows": rows})
        if not found and not any_live:
            return None
        return plan


def _classified(table: Table, row: dict[str, Any], sources: set[str], replaced: set[tuple]) -> dict[str, Any]:
    live, rebuilt = row["live"], row["rebuilt"]
    if live is not None and rebuilt is not None:
        kind = "changed"
    elif live is None:
        kind = "only_rebuilt"
    elif table.kind == SET:
        kind = "only_live" if tuple(live[c] for c in table.scope) in replaced else "kept"
    else:
        kind = "only_live" if live.get(table.source) in sources else "kept"
    return {**row, "kind": kind}


def _lock_keys(plan: _Plan) -> set[str]:
    """What a worker's batch locks for these rows' events: each object, and the customer and subscription
    its rows name (workers/processor.py, "Object locks")."""
    keys = plan.ids | plan.keys
    for table in plan.tables:
        for row in table["rows"]:
            for side in ("live", "rebuilt"):
                for column in ("customer_id", "subscription_id"):
                    value = (row.get(side) or {}).get(column)
                    if isinstance(value, str):
                        keys.add(value)
    return keys


def _write(conn: psycopg.Connection, plan: _Plan) -> dict[str, int]:
    """The plan's rows written (rowsql.repair) and removed (rowsql.repair_delete): how many of each."""
    written = {"written": 0, "removed": 0}
    by_name = {table.name: table for table, _ in HOLDERS}
    for entry in plan.tables:
        table = by_name[entry["table"]]
        rows = [r["rebuilt"] for r in entry["rows"] if r["kind"] in ("changed", "only_rebuilt")]
        gone = [{c: r["live"][c] for c in table.key} for r in entry["rows"] if r["kind"] == "only_live"]
        if rows:
            text = RENDERED.get(("repair", table.name), lambda: rowsql.repair(table))
            written["written"] += len(conn.execute(text, {"rows": rows_json(rows)}).fetchall())
        if gone:
            text = RENDERED.get(("repair-delete", table.name), lambda: rowsql.repair_delete(table))
            written["removed"] += len(conn.execute(text, {"rows": rows_json(gone)}).fetchall())
    return written
