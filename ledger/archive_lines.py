"""Archive lines: one event and every row that names it, as one line of JSON (docs/retention.md).

Built here, from the rows as the server writes them out as text (each column's own output, as
COPY writes it; no parsing per type on this side), so that the ledger's server only reads:
building JSON in Postgres cost a retention run about 65 µs of the server's CPU per event, beside
the receiver's inserts. The line is the one archive files have always held, so a restore
(ledger.event_restore_line) reads files written before and after alike: json_build_object of

- ``event``: the event's row as row_to_json writes it, its payload set to null;
- ``payload``: the payload as a string (the body Stripe signed, byte for byte);
- each table of DEPENDENTS: its rows naming the event, as json_agg of row_to_json in that order;

with every newline outside a string (json_agg's, a json column's) turned into a space, so the
line stays one line. tests/integration/test_archive_lines.py checks it byte for byte against
the SQL that wrote the files before (migration 0013).

Beside each line goes the event's *version*: every row the line was built from, named by its
table, place and writing transaction (tableoid, ctid, xmin). Any change to one of those rows
(an update, a delivery appended, a row removed) changes the version, so a removal compares
versions under the events' locks instead of building the lines again.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any, Callable, Iterable

from psycopg import IsolationLevel, sql as pgsql
from psycopg.rows import tuple_row
from psycopg.types.string import TextLoader

from ledger.queries import SQL

# The tables whose rows naming an event go into its line, in the line's order, each with its rows' order.
DEPENDENTS: tuple[tuple[str, str], ...] = (
    ("deliveries", "delivered_at, source"),
    ("attempts", "attempt"),
    ("audit", "id"),
    ("outbox", "id"),
    ("health_alerts", "recorded_at, alert_id"),
    ("snapshot_twins", "snapshot_event_id"),
    ("replay_job_events", "job_id"),
)
# Partitioned by their event's `created` on a partitioned ledger: read in the month's partitions only.
BY_MONTH = frozenset({"deliveries", "attempts"})
# The row's place, for its event's version: the first three columns every read selects.
PLACE_COLUMNS = ("tableoid", "ctid", "xmin")
# Types a line builder's connection reads as their text, unparsed: the columns' and the places'.
RAW_TYPES = ("integer", "bigint", "smallint", "boolean", "timestamptz", "json", "jsonb", "oid", "tid", "xid")


def _timestamptz(value: str) -> str:
    """The text ``2026-01-02 03:04:05.5+00`` as row_to_json writes it: ``"2026-01-02T03:04:05.5+00:00"``."""
    if value[-3:] == "+00" and value[10:11] == " ":  # a UTC session's: nearly every value
        return '"' + value[:10] + "T" + value[11:-3] + '+00:00"'
    if value.endswith("infinity"):
        return f'"{value}"'
    era = ""
    if value.endswith(" BC"):
        value, era = value[:-3], " BC"
    day, _, clock = value.partition(" ")
    sign = max(clock.rfind("+"), clock.rfind("-"))
    offset = clock[sign:]
    if len(offset) == 3:  # +HH
        offset += ":00"
    return f'"{day}T{clock[:sign]}{offset}{era}"'


# Each column type the ledger's tables use: how row_to_json writes it, from its text ``{v}`` (not NULL).
_RENDER: dict[str, str] = {
    "text": "escape({v})",   # escapes as Postgres' escape_json: " \ \b \f \n \r \t, other controls \u00XX
    "integer": "{v}",
    "bigint": "{v}",
    "smallint": "{v}",
    "boolean": '("true" if {v} == "t" else "false")',
    "timestamp with time zone": "timestamptz({v})",
    "json": "{v}",
    "jsonb": "{v}",
}


@dataclass(frozen=True)
class Table:
    """A ledger table's columns, in row_to_json's order, and ``to_json``: a row as read by ``select_list``
    (its place first), written as row_to_json writes it. ``to_json`` is compiled for the table's columns
    when it is read (one expression per row, no loop over columns): it runs for every row archived."""
    name: str
    columns: tuple[str, ...]
    to_json: Callable[[tuple], str]

    @classmethod
    def read(cls, conn, name: str, *, written_null: tuple[str, ...] = ()) -> "Table":
        """The table as the ledger has it now; ``written_null``: columns each row writes as null (an
        event's payload, which its line holds apart)."""
        columns, parts = [], []
        for column, type_name in conn.cursor(row_factory=tuple_row).execute(SQL.archive_table_columns,
                                                                             {"table": f"ledger.{name}"}):
            render = _RENDER.get(type_name)
            if render is None:
                raise TypeError(f"ledger.{name}.{column} is a {type_name}: an archive line cannot hold it yet")
            key = ("," if columns else "{") + encode_basestring(column) + ":"
            if column in written_null:
                parts.append(repr(key + "null"))
            else:
                v = f"r[{len(PLACE_COLUMNS) + len(columns)}]"
                parts += [repr(key), f'("null" if {v} is None else {render.format(v=v)})']
            columns.append(column)
        source = "lambda r: ''.join((" + ", ".join(parts + ["'}'"]) + "))"
        to_json = eval(source, {"escape": encode_basestring, "timestamptz": _timestamptz})
        return cls(name, tuple(columns), to_json)

    def select_list(self, alias: str = "x") -> pgsql.Composable:
        """The row's place, then its columns."""
        return pgsql.SQL(", ").join([pgsql.SQL("{}.{}").format(pgsql.Identifier(alias), pgsql.Identifier(c))
                                     for c in PLACE_COLUMNS + self.columns])

    def index(self, column: str) -> int:
        """Where ``column`` is in a row select_list reads."""
        return len(PLACE_COLUMNS) + self.columns.index(column)


def version_of(places: Iterable[str]) -> str:
    """An event's version: a digest of the places (table, ctid, xmin) of every row its line holds."""
    return hashlib.md5("|".join(sorted(places)).encode()).hexdigest()


@dataclass
class Line:
    event_id: str
    month: str        # YYYY-MM of Stripe's `created`: its archive file
    text: str
    version: str


class LineBuilder:
    """Lines of events read on one connection of its own (autocommit), its time zone set to UTC (a line's
    timestamps say +00:00 whoever builds it), every column read as the text the server writes: what a
    COPY writes, and half the client's CPU of reading a COPY row by row (5.5 against 10 µs an event)."""

    def __init__(self, conn):
        self._conn = conn
        for type_name in RAW_TYPES:
            conn.adapters.register_loader(type_name, TextLoader)
        conn.execute(SQL.archive_session_utc)
        conn.execute(SQL.archive_slice_ids_create)
        conn.isolation_level = IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        self.events = Table.read(conn, "events", written_null=("payload",))
        self.dependents = [Table.read(conn, name) for name, _ in DEPENDENTS]
        self._id = self.events.index("id")
        self._payload = self.events.index("payload")
        self._created = self.events.index("stripe_created")

    def lines(self, candidates: str, identifiers: dict[str, pgsql.Composable], params: dict[str, Any],
              bounds: dict[str, Any]) -> list[Line]:
        """The lines of the events ``candidates`` selects (a statement whose ``{columns}`` is given the
        events' select list, its other names ``identifiers``), each table's rows read in the month
        ``bounds`` names (NULLs: every month). One snapshot for all: a line holds the rows as they stood
        together (the connection's transactions are REPEATABLE READ)."""
        with self._conn.transaction():
            events = self._rows(pgsql.SQL(candidates).format(columns=self.events.select_list("e"), **identifiers),
                                params)
            if not events:
                return []
            # The ids go to the server once, for the slice's statements to read (a literal array of thousands
            # of them, composed and parsed for each table, cost more than the rows).
            with self._conn.cursor().copy(SQL.archive_slice_ids_copy) as copy:
                for row in events:
                    copy.write_row((row[self._id],))
            rows: dict[str, dict[str, list[tuple]]] = {}
            for table, (_, order) in zip(self.dependents, DEPENDENTS):
                statement = pgsql.SQL(SQL.archive_rows_of).format(
                    columns=table.select_list(), table=pgsql.Identifier("ledger", table.name),
                    month=pgsql.SQL(SQL.archive_rows_in_month if table.name in BY_MONTH else "TRUE"),
                    order=pgsql.SQL(order))
                by_event = rows[table.name] = {}
                event_id = table.index("event_id")
                for row in self._rows(statement, bounds):
                    by_event.setdefault(row[event_id], []).append(row)
        return [self._line(event, rows) for event in events]

    def _rows(self, query: pgsql.Composable, params: dict[str, Any]) -> list[tuple]:
        return self._conn.cursor(row_factory=tuple_row).execute(query, params).fetchall()

    def _line(self, event: tuple, rows: dict[str, dict[str, list[tuple]]]) -> Line:
        event_id = event[self._id]
        places = [":".join(event[:3])]
        parts = [f'{{"event" : {self.events.to_json(event)}, "payload" : {encode_basestring(event[self._payload])}']
        for table in self.dependents:
            mine = rows[table.name].get(event_id)
            if mine is None:
                parts.append(f'"{table.name}" : []')
                continue
            places += [":".join(row[:3]) for row in mine]
            parts.append(f'"{table.name}" : [' + ", \n ".join(map(table.to_json, mine)) + "]")
        text = (", ".join(parts) + "}").replace("\n", " ")
        return Line(event_id, event[self._created][:7], text, version_of(places))


def versions(conn, ids: list[str], bounds: dict[str, Any]) -> dict[str, str]:
    """The version of each of these events as the ledger holds it now (one it no longer holds has none)."""
    places: dict[str, list[str]] = {}
    for table in ("events",) + tuple(name for name, _ in DEPENDENTS):
        statement = pgsql.SQL(SQL.archive_row_places).format(
            event_id=pgsql.SQL("x.id" if table == "events" else "x.event_id"),
            table=pgsql.Identifier("ledger", table),
            month=pgsql.SQL(SQL.archive_events_in_month if table == "events" else
                            SQL.archive_rows_in_month if table in BY_MONTH else "TRUE"))
        for event_id, place in conn.cursor(row_factory=tuple_row).execute(statement, {"ids": ids, **bounds}):
            if table == "events":
                places[event_id] = [place]
            elif event_id in places:
                places[event_id].append(place)
    return {event_id: version_of(found) for event_id, found in places.items()}
