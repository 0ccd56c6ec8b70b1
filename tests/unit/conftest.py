"""Unit tests are pure: no PostgreSQL, no Redis, no processes of the product (fakeredis and in-process
HTTP servers are fine). A unit test that asks for a server fixture stops the run at collection."""
from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SERVER_FIXTURES = {"database_url", "db", "fresh_db", "redis_url", "settings"}


def pytest_collection_modifyitems(config, items):
    # Called with every item of the session, not only this folder's.
    wrong = [f"{item.nodeid} uses {', '.join(sorted(SERVER_FIXTURES & set(item.fixturenames)))}"
             for item in items
             if HERE in Path(item.path).resolve().parents and SERVER_FIXTURES & set(item.fixturenames)]
    if wrong:
        raise pytest.UsageError("unit tests need no server; move these to tests/integration:\n  " + "\n  ".join(wrong))
