"""Named SQL, loaded once from ``ledger/sql/*.sql``.

Each statement sits under a ``-- name: <name>`` line followed by comment lines
saying which transition it performs and why its guard is what it is. Nothing
else in the project writes SQL against ``ledger.*``.
"""
from __future__ import annotations

import re
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def load(package: str) -> dict[str, str]:
    queries: dict[str, str] = {}
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


class _Queries(dict):
    def __getattr__(self, name: str) -> str:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


SQL = _Queries(load("ledger.sql"))
