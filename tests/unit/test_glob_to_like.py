"""ledger.event_query.glob_to_like: the type globs operators pass to ledgerctl, as LIKE patterns; and the
bounds of their literal prefix (glob_prefix_range), which must hold every type a glob matches.

How Postgres then matches them is tested in tests/integration/test_cli_ledgerctl.py.
"""
from __future__ import annotations

import fnmatch

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.event_query import glob_prefix_range, glob_to_like


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


@given(name=st.text(alphabet=st.sampled_from("ab._%\\\U0010ffffé"), max_size=8), data=st.data())
def test_a_globs_prefix_bounds_hold_every_type_it_matches(name, data):
    """glob_prefix_range narrows by byte order what LIKE then matches exactly: it must never leave out a type
    the glob matches (a missing event in a filtered list). The glob is made from the type: some characters
    turned into ?, and the tail from some point into *."""
    wild = data.draw(st.sets(st.integers(0, max(0, len(name) - 1))))
    pattern = "".join("?" if i in wild else c for i, c in enumerate(name))
    cut = data.draw(st.integers(0, len(name)))
    if data.draw(st.booleans()):
        pattern = pattern[:cut] + "*"
    assert fnmatch.fnmatchcase(name, pattern.replace("[", "[[]"))
    bounds = glob_prefix_range(pattern)
    if bounds is not None:
        low, high = (b.encode() for b in bounds)
        assert low <= name.encode() < high
