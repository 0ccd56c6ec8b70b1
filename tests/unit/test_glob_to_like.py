"""ledger.event_query.glob_to_like: the type globs operators pass to ledgerctl, as LIKE patterns.

How Postgres then matches them is tested in tests/integration/test_cli_ledgerctl.py.
"""
from __future__ import annotations

import pytest

from ledger.event_query import glob_to_like


@pytest.mark.parametrize("pattern, like", [
    (None, None),
    ("invoice.paid", "invoice.paid"),
    ("invoice.*", "invoice.%"),
    ("*.updated", "%.updated"),
    ("test.?ffect", "test._ffect"),
    ("invoice.payment_failed", "invoice.payment\\_failed"),
    ("100%", "100\\%"),
    ("a\\b", "a\\\\b"),
    ("customer.subscription.*_*", "customer.subscription.%\\_%"),
])
def test_glob_to_like_turns_glob_wildcards_into_like_ones_and_escapes_like_metacharacters(pattern, like):
    assert glob_to_like(pattern) == like
