"""A retention run's pace (ledger/archive_builders.Pace): what is done is held to the budget's rate."""
from __future__ import annotations

import time

from ledger.archive_builders import Pace


def test_work_ahead_of_the_rate_waits_until_the_rate_allows_it():
    pace = Pace(max_rate=200)
    started = time.monotonic()
    pace.done(50)
    pace.done(50)
    assert time.monotonic() - started >= 100 / 200 - 0.01


def test_no_rate_never_waits():
    pace = Pace(max_rate=0)
    started = time.monotonic()
    pace.done(10_000_000)
    assert time.monotonic() - started < 0.4
