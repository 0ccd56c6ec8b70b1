"""Runs confirmed bulk replays (ledger.replay_jobs) in the console process, on a thread of its own.

It takes a running job under a lease (another console process takes it over once the lease
expired), replays it batch by batch at LEDGER_CONSOLE_REPLAY_RATE, and wakes each event replayed
after its batch committed. A cancel lands between two batches: the statement of the next one
finds the job cancelled and replays nothing. A wake-up the broker loses is the sweep's to re-drive,
as for every replay.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

from ledger.console import ConsoleLedger

log = logging.getLogger(__name__)

LEASE_S = 30.0
IDLE_S = 1.0


class ReplayRunner:
    def __init__(self, ledger: ConsoleLedger, wake: Callable[[str], object], *, rate_per_s: float):
        self._ledger = ledger
        self._wake = wake
        self._batch = max(1, int(rate_per_s))   # one batch a second
        self._runner = f"console@{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="replay-runner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def run_once(self) -> bool:
        """Advance one job by one batch; False when no job is running."""
        job = self._ledger.claim_replay_job(runner=self._runner, lease_s=LEASE_S)
        if job is None:
            return False
        status, replayed = self._ledger.replay_next(job["id"], runner=self._runner, batch=self._batch,
                                                    lease_s=LEASE_S)
        for event_id in replayed:
            self._wake(event_id)
        if status != "running":
            log.info("replay job ended", extra={"job_id": job["id"], "status": status or "cancelled"})
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                busy = self.run_once()
            except Exception as exc:  # Postgres away: try again; the lease keeps the job ours meanwhile
                log.error("replay runner failed a batch", extra={"error_class": type(exc).__name__})
                busy = False
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - started)) if busy else IDLE_S)
