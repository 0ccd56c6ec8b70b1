"""The SQL of the writers, composed from the table declarations (workers/rows.py): each statement's
shape written once here, whatever table it writes and wherever its rows come from.

A statement reads its rows from a ``source``: a relation with the table's row type. The live writer's
is a JSON array sent as one parameter (``jsonb_populate_recordset(NULL::<table>, %(p)s)``: one
parameter per table, whatever its columns' types); the rebuild's a staging table filled by COPY. The
target schema is a parameter too: billing, or a rebuild's shadow of it.

The order guard, in every upsert: a stored row is overwritten only by a newer change, by
(source_event_created, source_event_id); before that, a row of another account or mode raises
(billing.same_owner, migration 0006), so the outcome does not depend on which came first.
"""
from __future__ import annotations

from psycopg import sql

from workers.rows import LATEST, ONCE, SET, Table

OWNER_CHECK = "billing.same_owner"


def relation(table: Table, schema: str | None = None) -> sql.Composed:
    return sql.Identifier(schema or table.schema, table.relation)


def json_source(table: Table, schema: str | None, param: str) -> sql.Composed:
    """Rows sent as a JSON array in ``%(param)s``, typed as the table's rows."""
    return sql.SQL("jsonb_populate_recordset(NULL::{rel}, {param}::jsonb)").format(
        rel=relation(table, schema), param=sql.Placeholder(param))


def rows_where(table: Table, column: str) -> sql.Composed:
    """The rows whose ``column`` is one of ``%(values)s``, each as one JSON object of the columns handlers
    write (``row``): what an object's page and a repair compare."""
    return _as_json_rows(table, sql.SQL("{rel} WHERE {column} = ANY({values})").format(
        rel=relation(table), column=sql.Identifier(column), values=sql.Placeholder("values")))


def as_stored(table: Table) -> sql.Composed:
    """Rows sent as a JSON array (``%(rows)s``) as ``rows_where`` gives stored ones: typed by the table."""
    return _as_json_rows(table, json_source(table, None, "rows"))


def _as_json_rows(table: Table, source: sql.Composable) -> sql.Composed:
    return sql.SQL("SELECT to_jsonb(x) AS row FROM (SELECT {cols} FROM {source}) AS x").format(
        cols=_columns(table.all_columns), source=source)


def _columns(names) -> sql.Composed:
    return sql.SQL(", ").join(map(sql.Identifier, names))


def _target(table: Table) -> sql.Composable:
    return sql.SQL(table.conflict) if table.conflict else sql.SQL("({})").format(_columns(table.key))


def _guard(table: Table, *, or_same: bool = False) -> sql.Composable:
    """The WHERE of an upsert's DO UPDATE: the stored row ``t`` gives way to the change (EXCLUDED), if newer
    (``or_same``: or written by the same event, which only a repair rewrites)."""
    newer = sql.SQL("(t.source_event_created, t.source_event_id) "
                    "{op} (EXCLUDED.source_event_created, EXCLUDED.source_event_id)").format(
        op=sql.SQL("<=" if or_same else "<"))
    if not table.owner:
        return newer
    livemode = sql.SQL("t.livemode, EXCLUDED.livemode") if "livemode" in table.owner else sql.SQL("true, true")
    return sql.SQL("CASE WHEN {check}({name}, t.account, EXCLUDED.account, {livemode}) THEN {newer} END").format(
        check=sql.SQL(OWNER_CHECK), name=sql.Literal(table.relation), livemode=livemode, newer=newer)


def write(table: Table, schema: str | None, source: sql.Composable) -> sql.Composed:
    """The statement that writes ``source``'s rows into ``table``: an upsert under the order guard
    (LATEST), an insert of what is not there yet (ONCE), or the members of replaced sets (SET: see
    ``replace_delete`` for the rest of a replacement). ``source`` holds one row per key."""
    insert = _insert(table, schema, source)
    if table.kind in (ONCE, SET):
        return sql.SQL("{insert} ON CONFLICT {target} DO NOTHING").format(insert=insert, target=_target(table))
    return sql.SQL("{insert} ON CONFLICT {target} DO UPDATE SET {set} WHERE {guard}").format(
        insert=insert, target=_target(table), set=_assignments(table), guard=_guard(table))


def _insert(table: Table, schema: str | None, source: sql.Composable) -> sql.Composed:
    return sql.SQL("INSERT INTO {rel} AS t ({cols}) SELECT {cols} FROM {source} AS s").format(
        rel=relation(table, schema), cols=_columns(table.all_columns), source=source)


def _assignments(table: Table) -> sql.Composable | None:
    """An upsert's SET: a stored row keeps its key and its owner (the guard refuses another owner before
    anything is set); None for a table whose columns are all key and owner."""
    assignments = [sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c))
                   for c in table.all_columns if c not in table.key and c not in table.owner]
    if table.touch:
        assignments.append(sql.SQL("{c} = now()").format(c=sql.Identifier(table.touch)))
    return sql.SQL(", ").join(assignments) if assignments else None


def repair(table: Table) -> sql.Composed:
    """A repair's rewrite of some rows (``%(rows)s``, a JSON array) of one object or customer, rebuilt from
    its events (workers/object_repair.py): an upsert whose guard lets the same event's row be rewritten (a
    wrong row written by it) but never a newer one's; a once-written or set row is rewritten as given.
    Returns the keys written."""
    assignments = _assignments(table)
    where = sql.SQL(" WHERE {}").format(_guard(table, or_same=True)) if table.kind == LATEST else sql.SQL("")
    update = (sql.SQL("DO UPDATE SET {set}{where}").format(set=assignments, where=where)
              if assignments is not None else sql.SQL("DO NOTHING"))
    return sql.SQL("{insert} ON CONFLICT {target} {update} RETURNING {key}").format(
        insert=_insert(table, None, json_source(table, None, "rows")), target=_target(table), update=update,
        key=_columns(table.key))


def repair_delete(table: Table) -> sql.Composed:
    """A repair's removal of rows (``%(rows)s``, a JSON array of their keys) that its rebuild does not give
    although their source is one of the events it applied. Returns the keys removed."""
    same = sql.SQL(" AND ").join(sql.SQL("t.{c} IS NOT DISTINCT FROM s.{c}").format(c=sql.Identifier(c))
                                 for c in table.key)
    return sql.SQL("DELETE FROM {rel} AS t USING {source} AS s WHERE {same} RETURNING {key}").format(
        rel=relation(table), source=json_source(table, None, "rows"), same=same,
        key=sql.SQL(", ").join(sql.SQL("t.{}").format(sql.Identifier(c)) for c in table.key))


def replace_delete(table: Table, schema: str | None, scopes: sql.Composable,
                   members: sql.Composable) -> sql.Composed:
    """The first half of replacing sets: every stored row of a replaced scope (in ``scopes``) that is not
    among the new members (``members``) goes; ``write`` then adds the members not there yet."""
    if table.kind != SET:
        raise ValueError(f"{table.name} is not a set table")
    member_of_scope = sql.SQL(" AND ").join(sql.SQL("t.{c} = s.{c}").format(c=sql.Identifier(c)) for c in table.scope)
    same_member = sql.SQL(" AND ").join(sql.SQL("m.{c} = t.{c}").format(c=sql.Identifier(c)) for c in table.key)
    return sql.SQL("DELETE FROM {rel} AS t USING {scopes} AS s WHERE {scope} "
                   "AND NOT EXISTS (SELECT 1 FROM {members} AS m WHERE {member})").format(
        rel=relation(table, schema), scopes=scopes, scope=member_of_scope, members=members, member=same_member)


def read_latest(table: Table, schema: str | None, *, by: str | None = None) -> sql.Composed:
    """The stored rows of some keys (``%(keys)s``, a one-column key) and, with ``by``, every row whose
    ``by`` is one of ``%(groups)s``. A row known only by id carries '-infinity' as its created, which no
    Python datetime holds: it is read as the first second of year 1, below every event's."""
    if len(table.key) != 1:
        raise ValueError(f"{table.name}: stored rows are read by a one-column key")
    columns = [sql.SQL("greatest({c}, '0001-01-01 00:00:00+00') AS {c}").format(c=sql.Identifier(c))
               if c == "source_event_created" else sql.Identifier(c) for c in table.all_columns]
    where = sql.SQL("{key} = ANY({keys})").format(key=sql.Identifier(table.key[0]), keys=sql.Placeholder("keys"))
    if by is not None:
        where = sql.SQL("{where} OR {by} = ANY({groups})").format(where=where, by=sql.Identifier(by),
                                                                     groups=sql.Placeholder("groups"))
    return sql.SQL("SELECT {cols} FROM {rel} WHERE {where}").format(
        cols=sql.SQL(", ").join(columns), rel=relation(table, schema), where=where)


def read_groups(table: Table, schema: str | None) -> sql.Composed:
    """Every row of some groups (``%(groups)s``) of a set table."""
    return sql.SQL("SELECT {cols} FROM {rel} WHERE {group} = ANY({groups})").format(
        cols=_columns(table.all_columns), rel=relation(table, schema), group=sql.Identifier(table.group),
        groups=sql.Placeholder("groups"))


def kept(table: Table, live: str, shadow: str) -> sql.Composed:
    """A rebuild's keeping of ``table``'s live rows whose source it did not apply (``%(run)s``'s, by
    ledger.reprojection_rebuilt), into the shadow: ``write`` from those rows, among the rows the shadow
    does not hold with the same source. Returns each kept row's key columns and source."""
    same = sql.SQL(" AND ").join(sql.SQL("x.{c} IS NOT DISTINCT FROM l.{c}").format(c=sql.Identifier(c))
                                 for c in (*table.key, table.source))
    rows = sql.SQL("(SELECT l.* FROM {live} AS l WHERE NOT EXISTS (SELECT 1 FROM {shadow} AS x WHERE {same}) "
                   "AND NOT ledger.reprojection_rebuilt({run}::bigint, l.{source}))").format(
        live=relation(table, live), shadow=relation(table, shadow), same=same, run=sql.Placeholder("run"),
        source=sql.Identifier(table.source))
    returned = _columns(dict.fromkeys((*table.key, table.source)))
    return sql.SQL("{write} RETURNING {returned}").format(write=write(table, shadow, rows), returned=returned)


def copy_scopes(table: Table, live: str, shadow: str) -> tuple[sql.Composed, sql.Composed]:
    """The live rows of some scopes of a set table (``%(scopes)s``, a JSON array of scope rows) in place of
    the shadow's: the deletion, then the copy (which returns the copied rows' keys)."""
    scopes = json_source(table, shadow, "scopes")
    match = sql.SQL(" AND ").join(sql.SQL("t.{c} = s.{c}").format(c=sql.Identifier(c)) for c in table.scope)
    delete = sql.SQL("DELETE FROM {rel} AS t USING {scopes} AS s WHERE {match}").format(
        rel=relation(table, shadow), scopes=scopes, match=match)
    copy = sql.SQL("INSERT INTO {rel} SELECT t.* FROM {live} AS t, {scopes} AS s WHERE {match} "
                   "RETURNING {key}").format(rel=relation(table, shadow), live=relation(table, live), scopes=scopes,
                                             match=match, key=_columns(table.key))
    return delete, copy
