"""The processes that build a retention run's archive lines, within its budget (docs/retention.md).

Lines are built in Python (ledger/archive_lines.py), which is CPU a receiver on the same host
would otherwise get: so in processes of their own, niced (LEDGER_RETENTION_NICE), each with
its own connection, reading a slice of heap blocks per task; and handed out no faster than
LEDGER_RETENTION_MAX_RATE events a second over the run, so that a run beside live traffic
takes longer rather than taking the receiver's time. The parent only appends their chunks to
the month files, in the slices' order.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import psycopg
from psycopg import sql as pgsql

from ledger.archive import Chunk
from ledger.archive_lines import LineBuilder
from ledger.config import RetentionBudget, Settings
from ledger.db import session_guards
from ledger.queries import SQL


@dataclass(frozen=True)
class Slice:
    """A range of one heap's blocks; ``bounds``: its month's, on a partitioned ledger's month partition."""
    relation: str
    first_block: int
    end_block: int
    bounds: dict[str, Any]


# One builder's state, in its own process: its connection and its table shapes, made once.
_builder: LineBuilder | None = None


def at_most_priority(nice: int) -> int:
    """The calling thread niced to ``nice`` unless it already is at or past it (on Linux a niceness is a
    thread's, so a runner's thread of a worker process leaves the process's other threads as they were);
    the niceness it had before."""
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    if nice > before:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    return before


@contextmanager
def yielding(nice: int) -> Iterator[None]:
    """The calling thread niced to ``nice`` for the block: a retention run's own writing, verifying and
    removing give way to live traffic as its builders do. Put back after it where the process may raise
    its priority again (root, or CAP_SYS_NICE); elsewhere the thread stays niced, which the command's
    process and the sweep's retention thread, which only run retention, can afford."""
    before = at_most_priority(nice)
    try:
        yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), before)
        except PermissionError:
            pass


def _start(settings: Settings, nice: int) -> None:
    global _builder
    at_most_priority(nice)
    # A slice's rows and lines hold no reference cycles, and are freed by their counts when it is done:
    # the collector would only walk them, again and again, while they are built.
    gc.disable()
    # A session that ends soon after its process or host is gone, as every worker's (ledger.db).
    options, keepalives = session_guards(settings, name="ledger-retention-builder")
    conn = psycopg.connect(settings.database_url, autocommit=True, options=options, **keepalives)
    _builder = LineBuilder(conn)


def _build(piece: Slice, policy: dict[str, int]) -> tuple[int, dict[str, Chunk], float]:
    """One slice's events past their window, as compressed chunks per month; how many; the CPU it took."""
    assert _builder is not None
    cpu = time.process_time()
    lines = _builder.lines(SQL.retention_candidates, {"relation": pgsql.Identifier(*piece.relation.split("."))},
                           {**policy, "first_block": piece.first_block, "end_block": piece.end_block}, piece.bounds)
    by_month: dict[str, list[tuple[str, str, str]]] = {}
    for line in lines:
        by_month.setdefault(line.month, []).append((line.event_id, line.text, line.version))
    chunks = {month: Chunk.of(rows) for month, rows in by_month.items()}
    return len(lines), chunks, time.process_time() - cpu


class Pace:
    """Holds a count of things done to a rate over time: ``done(n)`` sleeps while they are ahead of it."""

    def __init__(self, max_rate: float):
        self._max_rate = max_rate
        self._started = time.monotonic()
        self._done = 0

    def done(self, n: int) -> None:
        self._done += n
        if self._max_rate > 0:
            ahead = self._started + self._done / self._max_rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)


class Builders:
    """A run's builder processes; ``chunks()`` yields each slice's chunks in the slices' order."""

    def __init__(self, settings: Settings, budget: RetentionBudget):
        self._budget = budget
        # The builders' CPU so far (seconds): a run reports it.
        self.cpu_s = 0.0
        # forkserver: a builder is forked from a clean process, never from the caller's threads and pools.
        self._pool = ProcessPoolExecutor(max_workers=max(1, budget.builders),
                                         mp_context=multiprocessing.get_context("forkserver"),
                                         initializer=_start, initargs=(settings, budget.nice))

    def __enter__(self) -> "Builders":
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def chunks(self, slices: Iterable[Slice], policy: dict[str, int]) -> Iterator[dict[str, Chunk]]:
        """Each slice's chunks by month. One slice per builder is in flight, and one more waits; a new one
        is handed out only once the events built so far are within the rate cap."""
        in_flight: deque[Future] = deque()
        pending = iter(slices)
        pace = Pace(self._budget.max_rate)
        window = max(1, self._budget.builders) + 1
        exhausted = False
        while True:
            while not exhausted and len(in_flight) < window:
                piece = next(pending, None)
                if piece is None:
                    exhausted = True
                    break
                in_flight.append(self._pool.submit(_build, piece, policy))
            if not in_flight:
                return
            count, chunks, cpu_s = in_flight.popleft().result()
            self.cpu_s += cpu_s
            yield chunks
            pace.done(count)
