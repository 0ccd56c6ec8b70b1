"""Indexes built without holding writers: the steps of a migration run outside a transaction.

``CREATE INDEX`` inside a migration's transaction holds a lock that refuses every insert into its
table until the build ends: minutes on a ledger of millions of events, with the receiver unable to
record what Stripe sends meanwhile. ``CREATE INDEX CONCURRENTLY`` lets writes go on, at a price
(Postgres documents it): it cannot run in a transaction, and a build interrupted (a killed
``ledgerctl migrate``, a lost connection, a deadlock) leaves an INVALID index behind, which
``IF NOT EXISTS`` would then take for done. So a build here first looks for the index: valid, it is
done; INVALID, it is dropped (concurrently too) and built again.

A migration may also drop an index a build of it replaced (``DROP INDEX CONCURRENTLY IF EXISTS``), after
that build: concurrently too, but a partitioned table's index has no concurrent drop, and is dropped in a
plain transaction whose lock waits at most ``DROP_LOCK_WAIT`` a try.

A partitioned table (``ledgerctl partitions migrate``) takes no concurrent build of its own: the
index is made on the parent alone (``ON ONLY``, invalid until every partition has its index), each
partition's is built concurrently and attached, and the parent's becomes valid with the last one. A
partition made later (ledger/partitions.py) gets it from the parent, as it gets every other index.

The builds are composed here from the migration file's parts (its identifiers quoted, its column list
and WHERE taken as written): they name relations only a migration knows. What they read of the
catalog is named SQL in ledger/sql/migrations.sql.
"""
from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from typing import Callable

import psycopg
from psycopg import sql

from ledger.errors import MigrationError
from ledger.queries import SQL

_STATEMENT = re.compile(
    r"CREATE\s+(?P<unique>UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+IF\s+NOT\s+EXISTS\s+(?P<name>[a-z_][a-z0-9_]*)\s+"
    r"ON\s+(?P<schema>[a-z_][a-z0-9_]*)\.(?P<table>[a-z_][a-z0-9_]*)\s+(?P<definition>\S.*)", re.S | re.I)
_DROP = re.compile(r"DROP\s+INDEX\s+CONCURRENTLY\s+IF\s+EXISTS\s+(?P<schema>[a-z_][a-z0-9_]*)\.(?P<name>[a-z_][a-z0-9_]*)",
                   re.I)
# A partitioned index cannot be dropped concurrently: its plain DROP takes the table's lock, for a moment
# (catalog only), waiting at most this long each try so that it never queues the receiver's inserts
# behind a long transaction for long.
DROP_LOCK_WAIT = "2s"
DROP_TRIES = 30
_COMMENT = re.compile(r"--[^\n]*")
MAX_NAME = 63  # Postgres' identifier length: a longer name would be cut, and two cut alike would collide


@dataclass(frozen=True)
class IndexBuild:
    name: str
    schema: str
    table: str
    definition: str  # what follows the table: [USING method] (columns) [INCLUDE ...] [WHERE ...]
    unique: bool = False


@dataclass(frozen=True)
class IndexDrop:
    """An index a build replaced: dropped once the new one is valid (the migration's order)."""
    name: str
    schema: str


def parse(text: str) -> list[IndexBuild | IndexDrop]:
    """The steps of a migration run outside a transaction, in its order; MigrationError for any other
    statement."""
    steps: list[IndexBuild | IndexDrop] = []
    for statement in _COMMENT.sub("", text).split(";"):
        statement = " ".join(statement.split())
        if not statement:
            continue
        if match := _STATEMENT.fullmatch(statement):
            steps.append(IndexBuild(match["name"], match["schema"], match["table"], match["definition"],
                                    bool(match["unique"])))
        elif match := _DROP.fullmatch(statement):
            steps.append(IndexDrop(match["name"], match["schema"]))
        else:
            raise MigrationError("a migration outside a transaction holds only 'CREATE [UNIQUE] INDEX CONCURRENTLY "
                                 "IF NOT EXISTS name ON schema.table ...' and 'DROP INDEX CONCURRENTLY IF EXISTS "
                                 f"schema.name': {statement[:120]!r}")
    if not any(isinstance(step, IndexBuild) for step in steps):
        raise MigrationError("a migration outside a transaction builds at least one index")
    return steps


def run(conn: psycopg.Connection, step: IndexBuild | IndexDrop, say: Callable[[str], None]) -> None:
    """One step of a migration outside a transaction: a build (``build``) or a drop (``drop``)."""
    if isinstance(step, IndexDrop):
        drop(conn, step, say)
    else:
        build(conn, step, say)


def drop(conn: psycopg.Connection, index: IndexDrop, say: Callable[[str], None]) -> None:
    """``index`` gone, if it is there: concurrently, or, for a partitioned one, in a short lock at a time."""
    row = conn.execute(SQL.index_kind, {"schema": index.schema, "name": index.name}).fetchone()
    if row is None:
        return
    target = sql.Identifier(index.schema, index.name)
    say(f"dropping index {index.schema}.{index.name}")
    if row[0] != "I":
        conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(target))
        return
    for attempt in range(DROP_TRIES):
        try:
            with conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout = '{DROP_LOCK_WAIT}'")
                conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(target))
            return
        except psycopg.errors.LockNotAvailable:
            if attempt == DROP_TRIES - 1:
                raise MigrationError(f"index {index.schema}.{index.name}: its table stayed locked; run "
                                     "`ledgerctl migrate` again") from None


def build(conn: psycopg.Connection, index: IndexBuild, say: Callable[[str], None]) -> None:
    """``index``, valid, on its table (``conn`` in autocommit), whatever an earlier, interrupted build left."""
    table = conn.execute(SQL.index_table, {"schema": index.schema, "table": index.table}).fetchone()
    if table is None:
        raise MigrationError(f"index {index.name}: no table {index.schema}.{index.table}")
    oid, kind, rows = table
    if kind == "p":
        _build_partitioned(conn, index, oid, say)
    else:
        _build_one(conn, index, index.name, index.table, rows, say)
    if _validity(conn, index.schema, index.name) is not True:
        raise MigrationError(f"index {index.schema}.{index.name} is not valid after its build")


def _build_one(conn: psycopg.Connection, index: IndexBuild, name: str, table: str, rows: int,
               say: Callable[[str], None]) -> None:
    valid = _validity(conn, index.schema, name)
    if valid:
        return
    if valid is False:
        say(f"index {index.schema}.{name} is INVALID (an interrupted build): dropping it to build it again")
        conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(sql.Identifier(index.schema, name)))
    say(f"building index {index.schema}.{name} on {index.schema}.{table} (about {rows:,} rows) concurrently: "
        "writes go on meanwhile")
    started = time.monotonic()
    conn.execute(sql.SQL("CREATE {unique}INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} {definition}").format(
        unique=sql.SQL("UNIQUE " if index.unique else ""), name=sql.Identifier(name),
        table=sql.Identifier(index.schema, table), definition=sql.SQL(index.definition)))
    say(f"built index {index.schema}.{name} in {time.monotonic() - started:.1f} s")


def _build_partitioned(conn: psycopg.Connection, index: IndexBuild, table_oid: int,
                       say: Callable[[str], None]) -> None:
    # The parent's own index is catalog only (no rows to read): its lock is brief.
    conn.execute(sql.SQL("CREATE {unique}INDEX IF NOT EXISTS {name} ON ONLY {table} {definition}").format(
        unique=sql.SQL("UNIQUE " if index.unique else ""), name=sql.Identifier(index.name),
        table=sql.Identifier(index.schema, index.table), definition=sql.SQL(index.definition)))
    partitions = conn.execute(SQL.index_partitions, {"parent_index": f"{index.schema}.{index.name}",
                                                     "table": table_oid}).fetchall()
    for partition, kind, rows, attached in partitions:
        if attached:
            continue
        if kind == "p":
            raise MigrationError(f"{index.schema}.{partition} is partitioned itself: not a shape the ledger makes")
        child = partition_index_name(index.name, partition)
        _build_one(conn, index, child, partition, rows, say)
        conn.execute(sql.SQL("ALTER INDEX {parent} ATTACH PARTITION {child}").format(
            parent=sql.Identifier(index.schema, index.name), child=sql.Identifier(index.schema, child)))


def partition_index_name(index: str, partition: str) -> str:
    name = f"{partition}__{index}"
    if len(name) <= MAX_NAME:
        return name
    return f"{name[:MAX_NAME - 9]}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _validity(conn: psycopg.Connection, schema: str, name: str) -> bool | None:
    """True for a valid index, False for an INVALID one, None where there is none."""
    row = conn.execute(SQL.index_validity, {"schema": schema, "name": name}).fetchone()
    return None if row is None else bool(row[0])
