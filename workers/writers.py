"""Writers: how the changes handlers record (workers/rows.py) reach their tables.

Every writer takes a batch's changes the same way (``flush``): what they need read (``rows.needs``),
read; the rows they come to, planned (``rows.plan``); then written, its own way:

* ``LiveWriter`` — on an apply transaction's connection (a worker's batch, a fetched object, a
  rebuild's catch-up into its shadow): one statement per table it must read, then one statement
  that writes every table, its rows sent as one JSON parameter per table.
* ``SliceWriter`` — a rebuild's slice into the shadow: each table's rows by COPY into a staging
  table, then one statement per table from there.
* ``MemoryWriter`` — into dicts: the rows of some events, nothing written anywhere.

The live writer is what a raw-SQL handler waits for: ``ctx.conn``'s first use flushes the batch's
changes so far, so such a handler sees its event's rows (workers/handlers.py).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Callable, Mapping

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from ledger import jsoncodec
from workers import rowsql
from workers.rows import (NEVER, Changes, EventRows, Needs, Plan, RowOfAnotherOwner, Stored,
                          Table, needs, order_of, plan)


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime) and value == NEVER:
        return "-infinity"
    return jsoncodec.isoformat(value)


def rows_json(rows: list[dict[str, Any]]) -> str:
    return jsoncodec.dumps(rows, default=_json_default)


class Writer:
    """What every writer shares: the changes of its batch, and ``flush``."""

    def __init__(self, schemas: Mapping[str, str] | None = None):
        self.changes = Changes()
        # Where each schema's tables are written: billing's into a rebuild's shadow, say.
        self.schemas = dict(schemas or {})
        self.written = 0
        # Called before a flush writes anything, and after it wrote (a worker's batch takes its members'
        # object locks there: workers/processor.py).
        self.before_write: Callable[[], None] | None = None
        self.after_write: Callable[[], None] | None = None

    def rows_for(self, *, event_id: str, created: datetime, account: str | None, livemode: bool) -> EventRows:
        """The ``ctx.rows`` of one event of this batch."""
        return EventRows(self.changes, event_id=event_id, created=created, account=account, livemode=livemode,
                         flush=self.flush)

    def schema(self, table: Table) -> str:
        return self.schemas.get(table.schema, table.schema)

    def flush(self) -> int:
        """Write what was recorded since the last flush; how many rows the statements wrote."""
        if self.changes.items and self.before_write is not None:
            self.before_write()
        items = self.changes.take()
        if not items:
            if self.after_write is not None:
                self.after_write()
            return 0
        wanted = needs(items)
        the_plan = plan(items, self.read(wanted) if wanted else Stored())
        written = self.write(the_plan) if the_plan else 0
        for announce in the_plan.announce:
            announce()
        self.written += written
        if self.after_write is not None:
            self.after_write()
        return written

    def discard(self) -> None:
        """Forget what was recorded since the last flush (its event was rolled back)."""
        self.changes.take()

    def read(self, wanted: Needs) -> Stored:
        raise NotImplementedError

    def write(self, the_plan: Plan) -> int:
        raise NotImplementedError


class _Rendered:
    """Statements rendered once per process, by what they are for: psycopg prepares by text, and
    composing one costs more than sending it."""

    def __init__(self):
        self._cache: dict[tuple, str] = {}

    def get(self, key: tuple, make: Callable[[], sql.Composable]) -> str:
        text = self._cache.get(key)
        if text is None:
            text = self._cache[key] = make().as_string(None)
        return text


RENDERED = _Rendered()


class _SqlWriter(Writer):
    """A writer on a connection: it reads the stored rows a plan needs with one statement per table."""

    def __init__(self, conn: psycopg.Connection, schemas: Mapping[str, str] | None = None):
        super().__init__(schemas)
        self.conn = conn

    def read(self, wanted: Needs) -> Stored:
        stored = Stored()
        groups = {table: (by, values) for (table, by), values in wanted.groups.items()}
        cursor = self.conn.cursor(row_factory=dict_row)
        for table, keys in wanted.keys.items():
            schema = self.schema(table)
            by, values = groups.get(table, (None, ()))
            text = RENDERED.get(("read", table.name, schema, by), lambda: rowsql.read_latest(table, schema, by=by))
            rows = cursor.execute(text, {"keys": sorted(k[0] for k in keys), "groups": sorted(values)}).fetchall()
            stored.latest[table] = {table.key_of(row): row for row in rows}
        for table, values in wanted.sets.items():
            schema = self.schema(table)
            text = RENDERED.get(("groups", table.name, schema), lambda: rowsql.read_groups(table, schema))
            stored.sets[table] = cursor.execute(text, {"groups": sorted(values)}).fetchall()
        return stored


class LiveWriter(_SqlWriter):
    """A batch's rows in one statement: a data-modifying CTE per table (the scopes' deletions among them),
    each reading its rows from one JSON parameter. Its text depends on which tables the batch writes."""

    def write(self, the_plan: Plan) -> int:
        parts: list[tuple[str, Table]] = []
        params: dict[str, str] = {}

        def add(op: str, table: Table, value: list[dict]) -> None:
            params[f"p{len(parts)}"] = rows_json(value)
            parts.append((op, table))

        # Tables in one order, whatever order the batch met them in: one statement text per set of tables.
        for table, rows in sorted(the_plan.latest.items(), key=_by_name):
            add("write", table, rows)
        for table, rows in sorted(the_plan.once.items(), key=_by_name):
            add("write", table, rows)
        for table, scopes in sorted(the_plan.sets.items(), key=_by_name):
            members = [member for _, rows in scopes.values() for member in rows]
            add("scopes", table, [scope_row for scope_row, _ in scopes.values()])
            add("delete", table, members)
            add("write", table, members)
        shape = tuple((op, table.name, self.schema(table)) for op, table in parts)
        text = RENDERED.get(("live",) + shape, lambda: self._statement(parts))
        row = self.conn.execute(text, params).fetchone()
        return sum(row)

    def _statement(self, parts: list[tuple[str, Table]]) -> sql.Composed:
        ctes, counts = [], []
        for n, (op, table) in enumerate(parts):
            schema = self.schema(table)
            source = rowsql.json_source(table, schema, f"p{n}")
            if op == "scopes":
                continue  # read by the deletion that follows it
            if op == "delete":
                statement = rowsql.replace_delete(table, schema, rowsql.json_source(table, schema, f"p{n - 1}"), source)
            else:
                statement = rowsql.write(table, schema, source)
            name = sql.Identifier(f"w{n}")
            ctes.append(sql.SQL("{name} AS ({statement} RETURNING 1)").format(name=name, statement=statement))
            counts.append(sql.SQL("(SELECT count(*) FROM {name})").format(name=name))
        return sql.SQL("WITH {ctes} SELECT {counts}").format(ctes=sql.SQL(", ").join(ctes),
                                                              counts=sql.SQL(", ").join(counts))


def _by_name(item: tuple[Table, Any]) -> str:
    return item[0].name


class SliceWriter(_SqlWriter):
    """A rebuild's slice: each table's rows by COPY into a staging table of this session (emptied at each
    COMMIT), then one statement per table from it into the shadow."""

    def __init__(self, conn: psycopg.Connection, schemas: Mapping[str, str]):
        super().__init__(conn, schemas)
        self._staged: set[str] = set()

    def write(self, the_plan: Plan) -> int:
        written = 0
        for table, rows in the_plan.latest.items():
            written += self._merge(table, self._stage(table, rows))
        for table, rows in the_plan.once.items():
            written += self._merge(table, self._stage(table, rows))
        for table, scopes in the_plan.sets.items():
            members = [member for _, rows in scopes.values() for member in rows]
            scope_stage = self._stage(table, [scope_row for scope_row, _ in scopes.values()], suffix="scopes")
            member_stage = self._stage(table, members)
            schema = self.schema(table)
            text = RENDERED.get(("slice-delete", table.name, schema), lambda: rowsql.replace_delete(
                table, schema, sql.Identifier(scope_stage), sql.Identifier(member_stage)))
            written += self.conn.execute(text).rowcount
            written += self._merge(table, member_stage)
        return written

    def _merge(self, table: Table, stage: str) -> int:
        """The staged rows into the shadow's table, as the live writer writes them (rowsql.write)."""
        schema = self.schema(table)
        text = RENDERED.get(("slice-write", table.name, schema),
                            lambda: rowsql.write(table, schema, sql.Identifier(stage)))
        return self.conn.execute(text).rowcount

    def _stage(self, table: Table, rows: list[dict], *, suffix: str = "") -> str:
        """The staging table of ``table`` (made once per session, shaped as its shadow, without its
        constraints), filled with ``rows`` by COPY."""
        schema = self.schema(table)
        name = f"stage_{schema}_{table.relation}{'_' + suffix if suffix else ''}"
        if name not in self._staged:
            self.conn.execute(sql.SQL("CREATE TEMP TABLE IF NOT EXISTS {stage} ON COMMIT DELETE ROWS AS "
                                      "SELECT * FROM {rel} WITH NO DATA").format(
                stage=sql.Identifier(name), rel=rowsql.relation(table, schema)))
            self._staged.add(name)
        columns = table.scope if suffix == "scopes" else table.all_columns
        json_columns = [c in table.json for c in columns]
        copy_sql = RENDERED.get(("copy", name, columns), lambda: sql.SQL("COPY {stage} ({cols}) FROM STDIN").format(
            stage=sql.Identifier(name), cols=sql.SQL(", ").join(map(sql.Identifier, columns))))
        with self.conn.cursor().copy(copy_sql) as copy:
            for row in rows:
                copy.write_row([_copy_value(row[c], is_json) for c, is_json in zip(columns, json_columns)])
        return name


def _copy_value(value: Any, is_json: bool) -> Any:
    if is_json:
        return Jsonb(value, dumps=jsoncodec.dumps) if value is not None else None
    if value is NEVER or (isinstance(value, datetime) and value == NEVER):
        return "-infinity"
    return value


class MemoryWriter(Writer):
    """Rows kept in dicts, by table and key: the same plans, written nowhere. ``tables()`` gives them."""

    def __init__(self):
        super().__init__()
        self.latest: dict[Table, dict[tuple, dict]] = {}
        self.once: dict[Table, dict[tuple, dict]] = {}
        self.sets: dict[Table, dict[tuple, dict]] = {}
        # The scopes of each set table that were replaced (emptied ones too): a repair replaces those.
        self.replaced: dict[Table, set[tuple]] = {}

    def read(self, wanted: Needs) -> Stored:
        stored = Stored()
        groups = {table: (by, values) for (table, by), values in wanted.groups.items()}
        for table, keys in wanted.keys.items():
            rows = self.latest.get(table, {})
            by, values = groups.get(table, (None, ()))
            stored.latest[table] = {key: row for key, row in rows.items()
                                    if key in keys or (by is not None and row.get(by) in values)}
        for table, values in wanted.sets.items():
            stored.sets[table] = [row for row in self.sets.get(table, {}).values() if row[table.group] in values]
        return stored

    def write(self, the_plan: Plan) -> int:
        written = 0
        for table, rows in the_plan.latest.items():
            kept = self.latest.setdefault(table, {})
            for row in rows:
                key = table.key_of(row)
                stored = kept.get(key)
                if stored is not None and table.owner and any(stored[c] != row[c] for c in table.owner):
                    raise RowOfAnotherOwner(table.name)
                if stored is None or order_of(stored) < order_of(row):
                    kept[key] = row
                    written += 1
        for table, rows in the_plan.once.items():
            kept = self.once.setdefault(table, {})
            for row in rows:
                if kept.setdefault(table.key_of(row), row) is row:
                    written += 1
        for table, scopes in the_plan.sets.items():
            kept = self.sets.setdefault(table, {})
            for scope, (scope_row, members) in scopes.items():
                self.replaced.setdefault(table, set()).add(scope)
                new = {table.key_of(m) for m in members}
                for key in [k for k, row in kept.items() if tuple(row[c] for c in table.scope) == scope
                            and k not in new]:
                    del kept[key]
                    written += 1
                for member in members:
                    if kept.setdefault(table.key_of(member), member) is member:
                        written += 1
        return written

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        """Every row written, by table name, in key order."""
        out: dict[str, list[dict]] = {}
        for store in (self.latest, self.once, self.sets):
            for table, rows in store.items():
                out.setdefault(table.name, []).extend(row for _, row in sorted(
                    rows.items(), key=lambda kv: tuple((v is None, str(v)) for v in kv[0])))
        return out

