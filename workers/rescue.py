"""The rescuer: takes over the leases of workers that are gone, in seconds instead of a lease.

Risk it handles: a worker process that dies holding claims (SIGKILL, OOM, a deploy that kills it
mid-batch), or whose host goes silent, holds its events until their leases expire: LEDGER_LEASE_S,
two minutes by default, long on purpose so that a slow handler is never taken over. Liveness tells
the two apart (ledger/liveness.py): a gone worker's Postgres session has ended and nobody holds its
key, while a slow or stopped one's session lives. Each pass (``run_once``) probes the keys of the
leased rows, expires the leases of gone owners in the same statement (their attempts closed as
worker_lost), and wakes each event and effect it rescued at once, whatever the broker's backlog.

A stopped worker (SIGSTOP, a frozen VM) is alive to Postgres: its lease governs. Once the lease has
run out, each pass ends the sessions that still hold its key (its liveness session, and an apply
transaction it left open mid-pipeline, which no idle timeout ends), so that the next claim can take
the rows they locked; the worker, resumed, finds its connections gone and its attempts fenced.

It runs in the sweep's process, every LEDGER_RESCUE_INTERVAL_S (1 s), on a thread of its own
(``run_until``). Several sweeps may run it: a key one probes is busy to the other, and rows are
taken with SKIP LOCKED, so nothing is rescued twice. A rescued owner that comes back late is
fenced by the next claim's new lease_owner, as after any lease expiry.

``worker_rescue_delay_seconds`` observes, per event, the time from the last pass that saw its
owner's session alive to the takeover: how long the rescue itself took. (Postgres declares a silent
host dead LEDGER_DEAD_PEER_S after it went quiet; that time comes before.)
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import psycopg

from ledger.attempts import WorkerLedger
from ledger.liveness import Probe
from ledger.outbox import OutboxLedger
from workers import metrics
from workers.wakeup import Waker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RescueResult:
    events: list[str]
    effects: list[int]


@dataclass
class Rescuer:
    ledger: WorkerLedger
    waker: Waker
    outbox: OutboxLedger | None = None
    clock: Callable[[], float] = time.monotonic
    # Liveness key -> when a pass last saw its session alive (keys still holding leases only).
    _last_alive: dict[int, float] = field(default_factory=dict, init=False, repr=False)

    def run_once(self) -> RescueResult:
        now = self.clock()
        try:
            ended = self.ledger.end_sessions_of_expired_leases()
        except psycopg.errors.InsufficientPrivilege:
            # Ending another role's sessions needs that role or pg_signal_backend (docs/deployment.md): the
            # stopped worker keeps its rows until it resumes or dies; the rescue of gone workers goes on.
            log.warning("cannot end a stopped worker's sessions: the sweep's role may not (grant it "
                        "pg_signal_backend, or run the sweep as the workers' role)")
            ended = []
        if ended:
            log.warning("ended the sessions of stopped workers whose leases ran out",
                        extra={"sessions_ended": len(ended)})
        events = self.ledger.rescue_owners_gone()
        effects = self.outbox.rescue_owners_gone() if self.outbox is not None else Probe(alive={}, rescued=[])
        for row in events.rescued:
            # Never seen alive by this rescuer (it just started): since the attempt began, at most.
            seen = self._last_alive.get(row["key"], now - (row["held_s"] or 0.0))
            metrics.RESCUE_DELAY.observe(max(0.0, now - seen))
            metrics.WORKER_RESCUES.labels("worker_gone", "event").inc()
            self.waker.wake(row["event_id"])
        for row in effects.rescued:
            metrics.WORKER_RESCUES.labels("worker_gone", "effect").inc()
            self.waker.wake_effect(row["outbox_id"])
        probed = {**events.alive, **effects.alive}
        # Alive now: seen now. Gone but with rows still leased (locked by its ending transaction, taken by
        # a later pass): when it was last seen alive.
        self._last_alive = {key: now if alive else self._last_alive[key] for key, alive in probed.items()
                            if alive or key in self._last_alive}
        result = RescueResult([row["event_id"] for row in events.rescued], [row["outbox_id"] for row in effects.rescued])
        if result.events or result.effects:
            gone = {row["key"] for row in [*events.rescued, *effects.rescued]}
            log.warning("took over the leases of gone workers", extra={
                "workers_gone": len(gone), "events_rescued": len(result.events), "effects_rescued": len(result.effects)})
        return result

    def run_until(self, stop: threading.Event, interval_s: float) -> None:
        while not stop.is_set():
            started = self.clock()
            try:
                self.run_once()
            except Exception as exc:  # Postgres away: the next pass tries again; leases still expire
                log.error("rescue pass failed; the next pass will try again", extra={"error_class": type(exc).__name__})
            stop.wait(max(0.0, interval_s - (self.clock() - started)))
