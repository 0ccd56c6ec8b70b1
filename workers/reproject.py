"""Re-projection: billing rebuilt from the ledger's stored payloads by the workers' own handlers, into a
shadow copy of its tables, compared with the live ones, switched in under a short lock, and undone.

What a rebuild runs: the handlers of the built-in billing module (``PROJECTED_MODULES``) and any a
user's module declares rebuilt (``@handler(..., rebuilt=True)``), taken from the registry the workers
load, with the same ``check_required`` and ``HandlerRegistry.apply``. They write through ``ctx.rows``
(workers/rows.py), and the rebuild's writers send their rows to the shadow of each table
(``billing_rebuild.<table>``) instead of the live one. Any other handler (a user's that writes tables of
its own by SQL, the health handler, which writes the ledger) is not run, and status lists it; a rebuilt
handler that reaches for ``ctx.conn`` fails its event, which is listed. Its context (``RebuildContext``)
records no effect and keeps no after-commit function; no call goes to Stripe: a thin notification is
applied from the object the worker fetched for it and the ledger kept (``applied_object``), and one
processed before the ledger kept it is listed. ledger.events is only read.

The order: the main pass applies every processed event in Stripe's order, (created, id). Rows keyed
by a Stripe id come out the same in any order (the order guard); the order makes the history
(billing.subscription_transitions' from_status) the one Stripe's events tell. Then catch-ups apply
the events processed since the rebuild started (ledger/sql/reprojection.sql, reprojection_catchup_cut)
until few are left; an apply takes the live tables' locks, applies the last ones and switches.
Re-applying an event is a no-op, so an event a catch-up meets twice changes nothing the second time.

How a slice is written: its events' handlers run one after the other, their rows kept in memory by the
slice's writer (``SliceWriter``: the newest change of each row, a transition per event, the sets of
the customers it touched), then flushed: each table's rows by COPY into a staging table, then one
statement per table into the shadow, under the same guard as live writes. A catch-up's slice goes
through the live writer instead (one statement for every table), as a worker's batch does. A slice is
one transaction, with the main pass's progress in it: a rebuild killed at any point goes on from its
last committed slice (``build`` again). An event whose handler fails is recorded as skipped (its
reason) and its rows left out; a slice whose flush fails is applied again one savepoint per event,
where the event at fault is skipped alone.
"""
from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import psycopg
from psycopg.rows import dict_row

from ledger import jsoncodec, stripe_events
from ledger.reprojection import (BEFORE, SHADOW, ReprojectionError, ReprojectionLedger, StoredEvent, TableDiff,
                                 UnknownTable)
from workers import thin
from workers.failures import PermanentError, classify
from workers.handlers import ApplyContext, HandlerRegistry, Registration, handler_name
from workers import rowsql
from workers.rows import DERIVED_FROM, NEVER, Derivation, Table
from workers.writers import RENDERED, LiveWriter, MemoryWriter, SliceWriter, Writer

# The modules whose handlers write only billing's tables: the ones a rebuild runs.
PROJECTED_MODULES = ("workers.billing.handlers",)
SLICE = 2000
# The main pass's processes. Each part's Python and its Postgres session take turns, so one part keeps one
# core busy at most: with spare cores, more parts go faster (100,000 events alone on 2 cores: 16.5 s with one
# part, 9.5 s with two). Beside live traffic on 2 cores there are none: two parts ran no faster, and the
# acknowledgements' p99 rose (docs/reprojection.md, "Parts").
PARTS = 1
# A build, or an apply before it takes the lock, catches up until one pass found this few events.
CATCHUP_FEW = 200
SWITCH_TRIES = 20
# ledger.reprojection_switch (migration 0015): views or foreign keys outside billing name its tables.
DEPENDENTS_SQLSTATE = "LR001"

Progress = Callable[[str, int, int], None]


def _module(fn: Any) -> str:
    return getattr(fn, "__module__", None) or type(fn).__module__


def projected(registry: HandlerRegistry) -> tuple[HandlerRegistry, list[Registration]]:
    """The registrations a rebuild runs (``PROJECTED_MODULES``', and those declared ``rebuilt``), in the
    workers' order, and the others."""
    kept, skipped = HandlerRegistry(), []
    for entry in registry.entries():
        if _module(entry.handler) in PROJECTED_MODULES or registry.is_rebuilt(entry.handler):
            kept.register(entry.pattern, entry.handler, entry.requires, rebuilt=True, writes=entry.writes)
        else:
            skipped.append(entry)
    return kept, skipped


class SqlInRebuild(PermanentError):
    """A handler a rebuild runs reached for ``ctx.conn``: a rebuild writes only what handlers hand to
    ``ctx.rows`` (its writers send those rows to the shadow), so the event is listed as not rebuilt."""

    reason = "raw_sql_in_rebuild"

    def __init__(self):
        super().__init__("a handler run by a rebuild used ctx.conn: a rebuilt handler writes only through ctx.rows")


class _NoConnection:
    """``ctx.conn`` in a rebuild: any use of it is SqlInRebuild."""

    def __getattr__(self, name: str) -> Any:
        raise SqlInRebuild()


@dataclass(frozen=True)
class RebuildContext(ApplyContext):
    """A handler's context in a rebuild: its rows go to the rebuild's writer, an effect is never recorded,
    an after-commit function never kept, and there is no connection to write by hand."""

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "conn", _NoConnection())
        object.__setattr__(self, "_raw", None)

    def emit(self, effect: str, payload: dict[str, Any], *, key: str | None = None,
             ordering_key: str | None = None, if_configured: bool = False) -> int | None:
        return None

    def on_commit(self, fn: Callable[[], None]) -> None:
        return None


class _Cancelled(Exception):
    """The run stopped building (cancelled) while a slice applied: the slice was rolled back."""


class Reprojection:
    def __init__(self, ledger: ReprojectionLedger, registry: HandlerRegistry, *, slice_size: int = SLICE,
                 parts: int = PARTS, progress: Progress | None = None):
        self.ledger = ledger
        self.parts = parts
        self.registry, self.not_projected = projected(registry)
        self.slice_size = slice_size
        self.progress = progress or (lambda phase, done, total: None)

    def handlers_not_run(self) -> list[dict[str, str]]:
        """The registrations a rebuild skips (their pattern, handler, module), as status lists them."""
        return [{"pattern": entry.pattern, "handler": handler_name(entry.handler), "module": _module(entry.handler)}
                for entry in self.not_projected]

    # Commands.

    def start(self, *, actor: str, scope: dict | None = None) -> dict:
        """A new rebuild, built to the end (``build``). Refused while another is building or built; a
        previous apply's undo is discarded (the tables before it dropped)."""
        scope = scope or {"all": True}
        with self.ledger.runner_lock():
            run = self.ledger.open_run()
            if run is not None and run["state"] != "applied":
                raise ReprojectionError(
                    f"rebuild {run['id']} is {run['state']}: nothing was started. "
                    + ("`ledgerctl reproject resume` finishes it, or `ledgerctl reproject cancel` drops it"
                       if run["state"] == "building" else
                       "`ledgerctl reproject apply` switches it in, or `ledgerctl reproject cancel` drops it"))
            dependents = self.ledger.dependents()
            if dependents:
                raise ReprojectionError(f"{', '.join(dependents)} name(s) billing tables from outside schema billing: "
                                        "an apply would leave them on the tables it sets aside (drop or recreate "
                                        "them around the rebuild): nothing was started")
            if run is not None:
                self.ledger.discard(run["id"], actor, run["scope"])
            with self.ledger.connection() as conn:
                self.ledger.drop_schema(conn, BEFORE)  # an undo kept by a rebuild whose run row is gone
                run = self.ledger.create(conn, actor=actor, scope=scope, parts=self.parts,
                                         tables=[table.relation for table in self.registry.tables_written()])
                if run["total"] == 0:
                    self.ledger.cancel(run["id"], actor, scope)
                    self.ledger.drop_schema(conn, SHADOW)
                    raise ReprojectionError("no processed event in the ledger to rebuild from: nothing was started")
            return self._build(run["id"])

    def resume(self) -> dict:
        """Go on with a rebuild that stopped while building (its process killed), from its last slice."""
        with self.ledger.runner_lock():
            run = self.ledger.open_run()
            if run is None or run["state"] != "building":
                raise ReprojectionError("no rebuild is building: nothing to resume")
            return self._build(run["id"])

    def cancel(self, *, actor: str) -> dict:
        """Drop a rebuild that is building or built. A process building it stops at its next slice."""
        run = self.ledger.open_run()
        if run is None or run["state"] not in ("building", "built"):
            raise ReprojectionError("no rebuild is building or built: nothing to cancel")
        self.ledger.cancel(run["id"], actor, run["scope"])
        with contextlib.suppress(ReprojectionError), self.ledger.runner_lock(), self.ledger.connection() as conn:
            self.ledger.drop_schema(conn, SHADOW)
        return self.ledger.get(run["id"])

    def discard(self, *, actor: str) -> dict:
        run = self.ledger.open_run()
        if run is None or run["state"] != "applied":
            raise ReprojectionError("no applied rebuild: nothing to discard")
        with self.ledger.runner_lock():
            self.ledger.discard(run["id"], actor, run["scope"])
        return self.ledger.get(run["id"])

    def diff(self, *, limit: int, tables: list[str] | None = None) -> tuple[dict, list[TableDiff]]:
        run = self._run_in("built", doing="diff")
        unknown = sorted(set(tables or ()) - set(run["tables"]))
        if unknown:
            raise UnknownTable(f"unknown table {', '.join(unknown)}: the rebuilt tables are "
                                    f"{', '.join(run['tables'])}")
        return run, self.ledger.diff(tables or run["tables"], limit=limit)

    def apply(self, *, actor: str, strict: bool = False) -> dict:
        """Switch a built rebuild in: catch up, take the live tables' locks, apply the last events, switch,
        in one transaction. The tables it replaces are kept for ``undo``. Refused with ``strict`` while any
        event is listed as not rebuilt."""
        run = self._run_in("built", doing="apply")
        skipped = self.ledger.skip_counts(run["id"])
        if strict and skipped:
            raise ReprojectionError(f"--strict: {sum(skipped.values())} event(s) could not be rebuilt "
                                    f"({_reasons(skipped)}): nothing was applied")
        with self.ledger.runner_lock(), self.ledger.connection() as conn:
            # The counts first: comparing whole tables takes a while, and the events processed meanwhile are
            # caught up before the lock, not under it.
            counts = {d.table: d.counts() for d in self.ledger.diff(run["tables"], limit=0)}
            self._keep(conn, run["id"])  # rows written since the build by no event (an object fetched meanwhile)
            # Last before the lock: what the workers processed while the tables were compared and kept rows merged
            # is caught up here, not under the lock.
            self._catch_up_until_few(conn, run["id"], "built", SHADOW)
            lock_ms = self._switch(conn, run, incoming=SHADOW, aside=BEFORE, catch_up_into=SHADOW,
                                   finish=lambda c: self._applied(c, run, actor, counts, skipped))
            self.ledger.drop_schema(conn, SHADOW)
        self.ledger.lock_held(run["id"], lock_ms)
        return self.ledger.get(run["id"])

    def undo(self, *, actor: str) -> dict:
        """Switch the tables an apply replaced back in, with the events processed since the apply applied to
        them first (by the handlers of now); the rebuilt tables are dropped."""
        run = self._run_in("applied", doing="undo")
        with self.ledger.runner_lock(), self.ledger.connection() as conn:
            self._catch_up_until_few(conn, run["id"], "applied", BEFORE)
            lock_ms = self._switch(conn, run, incoming=BEFORE, aside=SHADOW, catch_up_into=BEFORE,
                                   finish=lambda c: self._undone(c, run, actor))
            self.ledger.drop_schema(conn, SHADOW)
            self.ledger.drop_schema(conn, BEFORE)
        self.ledger.lock_held(run["id"], lock_ms)
        return self.ledger.get(run["id"])

    def _run_in(self, state: str, *, doing: str) -> dict:
        run = self.ledger.open_run()
        if run is None or run["state"] != state:
            now = f"rebuild {run['id']} is {run['state']}" if run else "no rebuild is open"
            raise ReprojectionError(f"nothing to {doing}: {now} (it must be {state}); nothing was changed")
        return run

    def _applied(self, conn: psycopg.Connection, run: dict, actor: str, counts: dict, skipped: dict) -> None:
        if not self.ledger.applied(conn, run["id"], actor):
            raise ReprojectionError(f"rebuild {run['id']} is no longer built: nothing was applied")
        self.ledger.audit(conn, run["id"], "apply", actor, run["scope"], {"tables": counts, "skipped": skipped})

    def _undone(self, conn: psycopg.Connection, run: dict, actor: str) -> None:
        if not self.ledger.undone(conn, run["id"]):
            raise ReprojectionError(f"rebuild {run['id']} is no longer applied: nothing was undone")
        self.ledger.audit(conn, run["id"], "undo", actor, run["scope"], {})

    # Building.

    def _build(self, run_id: int) -> dict:
        """The main pass, each part in a process of its own (forked: each opens its own session), then the
        catch-ups, then built. A part's process that fails leaves the run building, for ``resume``."""
        run = self.ledger.get(run_id)
        parts = [p for p in self.ledger.parts(run_id) if p["done"] < p["total"]]
        if len(parts) == 1:
            self._build_part(run, parts[0])
        elif parts:
            self._build_parts_in_processes(run, parts)
        with self.ledger.connection() as conn:
            try:
                self._catch_up_until_few(conn, run_id, "building", SHADOW)
            except _Cancelled:
                self.ledger.drop_schema(conn, SHADOW)
                return self.ledger.get(run_id)
            self._keep(conn, run_id)
            with conn.transaction():
                if not self.ledger.built(conn, run_id):
                    raise ReprojectionError(f"rebuild {run_id} stopped building (cancelled)")
        return self.ledger.get(run_id)

    def _keep(self, conn: psycopg.Connection, run_id: int) -> None:
        """Nothing a rebuild cannot see is lost by its apply: every live row whose source is an event the
        rebuild did not apply (ledger.reprojection_rebuilt: pruned, removed by retention, a thin notification
        whose object was not kept, one a handler now refuses, or no event at all: an object fetched from the
        API) is merged into the shadow under the same order guard as any write, and recorded as kept, which
        the diff lists. The sets derived from a kept row's table are derived again for its groups; a set
        replaced under a guard (Stripe's entitlements) takes the live members of a kept guard's scope. One
        transaction."""
        tables = self.registry.tables_written()
        with conn.transaction():
            self.ledger.create_kept(conn)
            regroup: dict[Derivation, set] = {}
            kept: dict[Table, list[dict]] = {}
            for table in tables:
                if table.source is None:
                    continue
                text = RENDERED.get(("kept", table.name), lambda t=table: rowsql.kept(t, t.schema, SHADOW))
                rows = conn.cursor(row_factory=dict_row).execute(text, {"run": run_id}).fetchall()
                if not rows:
                    continue
                kept[table] = rows
                self.ledger.record_kept(conn, table.relation, [[r[c] for c in table.key] for r in rows],
                                        [r[table.source] for r in rows])
            for table, rows in kept.items():
                for derivation in DERIVED_FROM.get(table, ()):
                    if derivation.table in tables:
                        found = self._groups(conn, table, derivation.by, rows)
                        regroup.setdefault(derivation, set()).update(found)
            for set_table in tables:
                for guard, rest in set_table.guards:
                    if guard in kept:
                        self._copy_scopes(conn, set_table, [{**{c: r[c] for c in guard.key}, **rest}
                                                            for r in kept[guard]])
            if regroup:
                writer = LiveWriter(conn, {"billing": SHADOW})
                rows_of = writer.rows_for(event_id="reprojection_kept", created=NEVER, account=None, livemode=False)
                for derivation, groups in regroup.items():
                    for group in sorted(groups, key=str):
                        rows_of.derive(derivation, group)
                writer.flush()

    def _groups(self, conn: psycopg.Connection, table: Table, by: str, rows: list[dict]) -> set:
        """The groups (``by``'s values) of kept rows of ``table``, read from the shadow where they were kept."""
        text = RENDERED.get(("kept-groups", table.name, by), lambda: rowsql.read_latest(table, SHADOW))
        stored = conn.cursor(row_factory=dict_row).execute(
            text, {"keys": [r[table.key[0]] for r in rows], "groups": []}).fetchall()
        return {r[by] for r in stored}

    def _copy_scopes(self, conn: psycopg.Connection, table: Table, scopes: list[dict]) -> None:
        delete, copy = RENDERED.get(("copy-scopes-delete", table.name), lambda: rowsql.copy_scopes(
            table, table.schema, SHADOW)[0]), RENDERED.get(("copy-scopes", table.name), lambda: rowsql.copy_scopes(
            table, table.schema, SHADOW)[1])
        params = {"scopes": jsoncodec.dumps(scopes)}
        conn.execute(delete, params)
        rows = conn.cursor(row_factory=dict_row).execute(copy, params).fetchall()
        if rows:
            self.ledger.record_kept(conn, table.relation, [[r[c] for c in table.key] for r in rows], [None] * len(rows))

    def _build_parts_in_processes(self, run: dict, parts: list[dict]) -> None:
        context = multiprocessing.get_context("fork")
        processes = [context.Process(target=self._build_part, args=(run, part), kwargs={"parent": os.getpid()},
                                     name=f"reproject-part-{part['part']}") for part in parts]
        for process in processes:
            process.start()
        try:
            while any(process.is_alive() for process in processes):
                time.sleep(0.5)
                self.progress("build", self.ledger.get(run["id"])["done"], run["total"])
        finally:
            for process in processes:
                process.join()
        failed = [process.name for process in processes if process.exitcode != 0]
        if failed:
            raise ReprojectionError(f"{', '.join(failed)} stopped (exit codes "
                                    f"{[p.exitcode for p in processes]}): the rebuild is still building; "
                                    "`ledgerctl reproject resume` goes on from where each part got to")

    def _build_part(self, run: dict, part: dict, *, parent: int | None = None) -> None:
        """One part of the main pass, slice by slice, from where it got to. In a child, it stops when its
        parent is gone (a killed ``start`` leaves no part running for ``resume`` to race)."""
        run_id, number, done, total = run["id"], part["part"], part["done"], part["total"]
        with self.ledger.connection() as conn, _collected_per_slice():
            writer = SliceWriter(conn, {"billing": SHADOW})
            try:
                while done < total:
                    gc.collect()
                    if parent is not None and os.getppid() != parent:
                        return
                    events = self.ledger.queued_events(conn, number, done, self.slice_size)
                    reached = min(done + self.slice_size, total)
                    self._apply_slice(conn, writer, run_id, events,
                                      finish=lambda c, n=reached: self.ledger.advance(c, run_id, number, n))
                    done = reached
                    if parent is None:
                        self.progress("build", done, total)
            except _Cancelled:
                return

    def _catch_up_until_few(self, conn: psycopg.Connection, run_id: int, state: str, schema: str) -> None:
        while self._catch_up(conn, run_id, state, schema) > CATCHUP_FEW:
            pass

    def _catch_up(self, conn: psycopg.Connection, run_id: int, state: str, schema: str, *, locked: bool = False) -> int:
        """One catch-up pass: every event processed since the run's ``caught_up_to``, applied to ``schema``'s
        tables by the live writer; the next pass's start recorded. ``locked``: inside the switch's
        transaction (its slices are savepoints)."""
        since = self.ledger.get(run_id)["caught_up_to"]
        cut = self.ledger.catchup_cut(conn)
        keys = self.ledger.processed_since(conn, since)
        applied = 0
        for at in range(0, len(keys), self.slice_size):
            events = self.ledger.events_by_key(conn, keys[at:at + self.slice_size])
            self._apply_slice(conn, LiveWriter(conn, {"billing": schema}), run_id, events, finish=lambda c: True,
                              fast=not locked)
            applied += len(events)
            self.progress("catch-up", at + len(events), len(keys))
        if not self.ledger.record_catchup(conn, run_id, state, cut, applied):
            raise _Cancelled()
        return applied

    def _switch(self, conn: psycopg.Connection, run: dict, *, incoming: str, aside: str, catch_up_into: str,
                finish: Callable[[psycopg.Connection], None]) -> float:
        """One transaction: the live tables locked, the last events applied to ``catch_up_into``, ``incoming``'s
        tables switched in (the live ones to ``aside``), ``finish``. Tried again while a lock is not had in
        time (a reader or a worker in the way). How long the locks were held, in ms."""
        for attempt in range(SWITCH_TRIES):
            try:
                with conn.transaction():
                    self.ledger.lock_tables(conn, run["tables"])
                    locked_at = time.perf_counter()
                    self._catch_up(conn, run["id"], run["state"], catch_up_into, locked=True)
                    self.ledger.switch(conn, incoming=incoming, aside=aside, tables=run["tables"])
                    finish(conn)
                return (time.perf_counter() - locked_at) * 1000
            except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected):
                time.sleep(min(0.05 * (attempt + 1), 0.5))
            except psycopg.Error as exc:
                if exc.sqlstate == DEPENDENTS_SQLSTATE:  # ledger.reprojection_switch's refusal
                    raise ReprojectionError(exc.diag.message_primary) from None
                raise
        raise ReprojectionError(f"the live tables' locks were not had in {SWITCH_TRIES} tries: nothing was switched")

    # Applying events.

    def _apply_slice(self, conn: psycopg.Connection, writer: Writer, run_id: int, events: list[StoredEvent], *,
                     finish: Callable[[psycopg.Connection], bool], fast: bool = True) -> None:
        """``events`` applied in one transaction (a savepoint when one is open), then ``finish`` in it (False:
        the run was cancelled, and the slice rolled back). Every event's handlers run, their rows kept by
        ``writer`` and flushed once; an event whose handlers fail is skipped, its rows left out. When the
        flush fails, the slice again with a savepoint and a flush per event, where the event at fault is
        skipped alone."""
        todo, unbuildable = [], []
        for event in events:
            reason = _unbuildable(event)
            if reason:
                unbuildable.append((event, *reason))
            else:
                todo.append(event)
        if fast:
            try:
                with conn.transaction():
                    applied, failed = [], []
                    for event in todo:
                        mark = writer.changes.mark()
                        try:
                            self._apply_event(writer, event)
                            applied.append(event)
                        except Exception as exc:  # classified right here, where it is caught
                            writer.changes.rollback(mark)
                            failed.append((event, *_skip_reason(exc)))
                    writer.flush()
                    self._close_slice(conn, run_id, applied, unbuildable + failed, finish)
                return
            except _Cancelled:
                raise
            except Exception:  # noqa: BLE001 - some event's rows: the slice again, one savepoint each, finds which
                writer.discard()
                if conn.broken:
                    raise
        with conn.transaction():
            applied = []
            for event in todo:
                one = LiveWriter(conn, writer.schemas)
                try:
                    with conn.transaction():
                        self._apply_event(one, event)
                        one.flush()
                    applied.append(event)
                except Exception as exc:  # classified right here, where it is caught
                    if conn.broken:
                        raise
                    unbuildable.append((event, *_skip_reason(exc)))
            self._close_slice(conn, run_id, applied, unbuildable, finish)

    def _close_slice(self, conn: psycopg.Connection, run_id: int, applied: list[StoredEvent],
                     unbuildable: list[tuple[StoredEvent, str, str]], finish) -> None:
        if applied:
            self.ledger.unskip(conn, run_id, [event.id for event in applied])
        for event, reason, detail in unbuildable:
            self.ledger.skip(conn, run_id, event, reason, detail)
        if not finish(conn):
            raise _Cancelled()

    def _apply_event(self, writer: Writer, event: StoredEvent) -> None:
        """What a worker's attempt runs for the event (EventProcessor._run_handlers), its rows to ``writer``."""
        apply_stored(self.registry, writer, event)


@contextlib.contextmanager
def _collected_per_slice():
    """Python's cycle collector off for the main pass, run once between slices instead: a slice's payloads
    are thousands of live dicts, which every automatic pass would walk again (a quarter of a rebuild's
    time); between slices almost nothing is alive."""
    enabled = gc.isenabled()
    gc.disable()
    gc.freeze()  # what is alive before the pass (modules, the registry) is not walked again each slice
    try:
        yield
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def apply_stored(registry: HandlerRegistry, writer: Writer, event: StoredEvent) -> None:
    """A stored event's handlers, as a worker ran them, their rows recorded by ``writer`` (not flushed): a
    snapshot event as delivered, a thin notification as the object the worker fetched for it."""
    applied = thin.stored(event)
    event_type = stripe_events.handler_type(applied.type)
    if not registry.resolve(event_type):
        return  # no rebuilt handler takes it: nothing of it is in billing
    payload = applied.event
    registry.check_required(event_type, payload, payload.get("api_version") or event.api_version)
    event_id = applied.snapshot_twin or event.id
    registry.apply(RebuildContext(
        conn=None, event_id=event_id, event_type=event_type, created=event.created, livemode=event.livemode,
        account=event.account, event=payload, attempt=0, ledger_event_id=event.id,
        rows=writer.rows_for(event_id=event_id, created=event.created, account=event.account,
                             livemode=event.livemode)))


def object_rows(registry: HandlerRegistry, events: Iterable[StoredEvent]) -> dict[str, list[dict[str, Any]]]:
    """The rows the rebuilt handlers give for ``events`` alone (one object's, say), in Stripe's order, by
    table name: the same mapping and plan as a rebuild, kept in memory, nothing read or written. An event
    that cannot be rebuilt, or whose handlers fail, gives no row."""
    return object_writer(registry, events).tables()


def object_writer(registry: HandlerRegistry, events: Iterable[StoredEvent]) -> MemoryWriter:
    """``object_rows``' writer, holding the rows and which scopes of each set table were replaced."""
    kept, _ = projected(registry)
    writer = MemoryWriter()
    for event in sorted(events, key=lambda e: (e.created, e.id)):
        if _unbuildable(event):
            continue
        mark = writer.changes.mark()
        try:
            apply_stored(kept, writer, event)
        except Exception:  # noqa: BLE001 - an event that fails gives no row, as in a rebuild (where it is listed)
            writer.changes.rollback(mark)
            continue
        writer.flush()
    return writer


def _skip_reason(exc: Exception) -> tuple[str, str]:
    failure = classify(exc)
    return failure.reason, f"{failure.error_class}: {failure.message}"[:500]


def _unbuildable(event: StoredEvent) -> tuple[str, str] | None:
    """Why a processed event cannot be rebuilt from the ledger, if it cannot."""
    if event.payload is None:
        return ("payload_pruned", "ledgerctl prune removed its payload: `ledgerctl backfill` fetches the object's "
                "current state from Stripe's API; its transitions cannot be recovered")
    if stripe_events.is_thin(event.payload) and event.applied_object is None:
        return ("thin_not_kept", "a thin notification processed before the ledger kept the object a worker fetched "
                "for it; its rows are kept through an apply")
    return None


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))
