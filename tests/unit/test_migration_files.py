"""The migrations the release ships (ledger/migrations), read without a database."""
from __future__ import annotations

from ledger.migrate import available_migrations


def test_migrations_are_numbered_one_to_n_without_gaps():
    versions = [m.version for m in available_migrations()]

    assert versions == list(range(1, len(versions) + 1)) and versions
