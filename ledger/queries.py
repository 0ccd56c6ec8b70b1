"""Named SQL: one loader, one convention, for every package that keeps SQL.

Each statement sits under a ``-- name: <name>`` line followed by comment lines
saying which transition it performs and why its guard is what it is; code calls
it by name (``SQL.event_claim``). ``SQL`` holds every ``ledger/sql/*.sql``: the
only statements on ``ledger.*``. The operator's reads of ``billing.*`` load the same way from
``workers/billing/reads.sql``; the handlers' writes are composed from the table declarations
(workers/rowsql.py). Code outside ledger/ never imports ``SQL`` or the statement runner
(tests/unit/test_layout.py): it goes through a ledger class.
"""
from __future__ import annotations

import re
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


class Queries(dict):
    """Statements by name, also as attributes: ``SQL.event_claim``."""

    def __getattr__(self, name: str) -> str:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def load(package: str) -> Queries:
    """Every statement of every ``*.sql`` file in ``package``."""
    queries = Queries()
    for entry in sorted(resources.files(package).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql"):
            queries.update(parse(entry.read_text()))
    return queries


def parse(text: str) -> dict[str, str]:
    parts = _NAME.split(text)
    queries = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = body.strip().rstrip(";")
    return queries


SQL = load("ledger.sql")
