"""The PostgreSQL server a test session uses, resolved once, on first use, and databases made on it.

In order: ``TEST_PG_URL`` or ``DATABASE_URL`` if set (an admin URL: one that may CREATE DATABASE);
else the machine's server if something answers on 127.0.0.1:5432 (postgresql://postgres@127.0.0.1:5432/postgres);
else a ``devkit.servers.PrivatePostgres`` started for the session, which ``shutdown()`` destroys
(tests/conftest.py calls it when pytest ends). Nothing is resolved until a test needs a database,
so the unit tests never look for a server.

``ADMIN_URL`` is the resolved URL as a module attribute, for modules that want a plain name
(``from tests.support.postgres import ADMIN_URL`` resolves it at that import).
"""
from __future__ import annotations

import contextlib
import os
import uuid
from typing import Iterator

import psycopg

from devkit.procs import answers
from devkit.servers import TEST_OPTIONS, PrivatePostgres, with_db

MACHINE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"

_resolved: str | None = None
_source: str | None = None
_private: PrivatePostgres | None = None


def admin_url() -> str:
    """The session's admin URL (resolved, and if need be the private server started, on the first call)."""
    global _resolved, _source, _private
    if _resolved is None:
        given = next((name for name in ("TEST_PG_URL", "DATABASE_URL") if os.environ.get(name)), None)
        if given:
            _resolved, _source = os.environ[given], f"the server of {given}"
        elif answers(5432):
            _resolved, _source = MACHINE_URL, "the machine's server on 127.0.0.1:5432"
        else:
            server = PrivatePostgres(options=TEST_OPTIONS).init()
            try:
                server.start()
            except BaseException:
                server.destroy()
                raise
            _private = server
            _resolved = server.url
            _source = f"a private server started for this session on 127.0.0.1:{server.port} ({server.dir})"
    return _resolved


def described() -> str | None:
    """Which server the session uses, in words (no URL: it may carry a password); None if none was needed."""
    return _source


def shutdown() -> None:
    """Destroy the session's private server, if one was started."""
    global _private, _resolved, _source
    if _private is not None:
        _private.destroy()
        _private = None
        _resolved = _source = None


@contextlib.contextmanager
def scratch_database(prefix: str) -> Iterator[str]:
    """An empty database of its own (a unique name starting with ``prefix``), dropped afterwards; yields its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    url = admin_url()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield with_db(url, name)
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def __getattr__(name: str) -> str:
    if name == "ADMIN_URL":
        return admin_url()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
