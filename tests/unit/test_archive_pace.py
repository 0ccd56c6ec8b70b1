"""A retention run's pace and priority (ledger/archive_builders): what is done is held to the budget's
rate, and the run's own thread gives way to live traffic while it runs."""
from __future__ import annotations

import os
import threading
import time

from ledger.archive_builders import Pace, yielding


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


def _niceness(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_a_run_thread_is_niced_while_it_runs_and_the_process_other_threads_are_not():
    seen: dict[str, int] = {}
    main = threading.get_native_id()
    before = _niceness(main)

    def run() -> None:
        tid = threading.get_native_id()
        with yielding(before + 5):
            seen["runner"], seen["other"] = _niceness(tid), _niceness(main)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == {"runner": before + 5, "other": before}


def test_a_thread_already_niced_further_is_left_as_it_is():
    before = _niceness(threading.get_native_id())
    with yielding(max(0, before - 1)):
        assert _niceness(threading.get_native_id()) == before
