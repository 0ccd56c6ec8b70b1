"""Named SQL of the development toolkit: every statement the chaos run and the benchmarks send.

Same convention as ``ledger/sql/*.sql`` (parsed by ``ledger.queries``): each statement
under a ``-- name: <name>`` line, then a comment saying what it measures or sets up
and why. Where the tooling runs what the product runs (pgbench's scripts, the sweep's
plan) it takes the product's own statement from ``ledger.queries.SQL``, not a copy.

A template with ``{placeholders}`` takes identifiers (database, role, table, index and
column names) through ``compose``, never through string formatting.
"""
from __future__ import annotations

from types import SimpleNamespace

from psycopg import sql

from ledger.queries import load

SQL = SimpleNamespace(**load(__name__))


def _identifier(name: str) -> sql.Identifier:
    return sql.Identifier(*name.split("."))


def compose(template: str, **parts: str | list[str] | tuple[str, ...] | sql.Composable) -> sql.Composed:
    """``template`` with its placeholders filled: a name (``schema.table`` allowed) or a list of
    names (comma-separated) as quoted identifiers; a ``psycopg.sql`` object as it is."""
    def part(value):
        if isinstance(value, sql.Composable):
            return value
        if isinstance(value, str):
            return _identifier(value)
        return sql.SQL(", ").join(_identifier(v) for v in value)
    return sql.SQL(template).format(**{key: part(value) for key, value in parts.items()})
