"""Rescue in seconds, with real worker processes and the real sweep (``ledgerctl sweep --loop``), the lease left at
the default 120 s: a pool process SIGKILLed mid-batch and a whole pool SIGKILLed mid-batch have their events taken
over by the rescuer (attempts closed as worker_lost) long before any lease could expire, each effect once; a handler
that runs three times the rescue target is never taken over; a worker stopped with SIGSTOP keeps its lease until
it runs out, then is taken over, and is fenced once resumed. On Redis and on a RabbitMQ vhost of the test's own.

A host cut off by a partition is tests/e2e/test_multihost.py's.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from devkit.factories import event
from devkit.procs import pid_alive, wait_until
from devkit.stack import Sweep
from tests.support.ledger_fixtures import BROKERS
from tests.support.workers import env_for
from workers.app import make_celery
from workers.wakeup import Waker

pytestmark = pytest.mark.parametrize("broker_settings", BROKERS, indirect=True)

RESCUE_TARGET_S = 15.0


@pytest.fixture
def stack(broker_settings, tmp_path):
    """Settings as deployed (lease 120 s, rescue every 1 s), the sweep running, and a waker."""
    settings = dataclasses.replace(broker_settings, lease_s=120, sweep_interval_s=1.0, sweep_overdue_s=2.0)
    sweep = Sweep(env_for(settings), tmp_path).start()
    celery = make_celery(settings, publisher_only=True)
    try:
        yield settings, Waker(celery)
    finally:
        sweep.kill()
        celery.close()


def slow_events(kit, n: int, *, sleep_s: float, tag: str) -> list[str]:
    now = int(time.time())
    return [kit.record(event("test.effect", {"id": f"obj_{tag}_{i}", "sleep_s": sleep_s}, created=now))
            for i in range(n)]


def held_by(kit, ids: list[str], pids: list[int]) -> dict[str, int]:
    """The events of ``ids`` whose running attempt belongs to one of ``pids``: event id -> pid."""
    rows = kit.query("SELECT event_id, worker FROM ledger.attempts WHERE event_id = ANY(%s) AND outcome = 'running'",
                     (ids,))
    return {row["event_id"]: int(row["worker"].rsplit(":", 1)[1]) for row in rows
            if int(row["worker"].rsplit(":", 1)[1]) in pids}


def wake_until_held(kit, waker, ids: list[str], worker, what: str) -> dict[str, int]:
    """Wake ``ids`` and wait until ``worker``'s pool processes hold some of them: event id -> pid."""
    for evt_id in ids:
        waker.wake(evt_id)
    return wait_until(lambda: held_by(kit, ids, worker.children()), timeout_s=30, interval_s=0.05, what=what)


def wait_processed(kit, ids: list[str], timeout_s: float) -> float:
    started = time.monotonic()
    wait_until(lambda: kit.query("SELECT count(*) AS n FROM ledger.events WHERE id = ANY(%s) AND status = 'processed'",
                                 (ids,))[0]["n"] == len(ids), timeout_s=timeout_s, interval_s=0.1,
               what=f"{len(ids)} events to be processed")
    return time.monotonic() - started


def assert_once_and_rescued(kit, ids: list[str], rescued: set[str]) -> None:
    effects = kit.query("SELECT event_id, count(*) AS n FROM public.test_effects WHERE event_id = ANY(%s) "
                        "GROUP BY event_id", (ids,))
    assert {row["event_id"]: row["n"] for row in effects} == {evt_id: 1 for evt_id in ids}
    for evt_id in rescued:
        outcomes = [a["outcome"] for a in kit.attempts(evt_id)]
        assert outcomes[0] == "worker_lost" and outcomes[-1] == "processed", (evt_id, outcomes)
        assert "lease_expired" not in outcomes


def test_a_killed_pool_process_and_a_killed_pool_are_rescued_in_seconds_and_a_slow_handler_never(
        kit, stack, worker_factory):
    settings, waker = stack
    # The slow one: three times the rescue target, on a worker nobody kills.
    steady = worker_factory(settings, concurrency=1, label="steady")
    [slow] = slow_events(kit, 1, sleep_s=3 * RESCUE_TARGET_S, tag="slow")
    waker.wake(slow)
    wait_until(lambda: held_by(kit, [slow], steady.children()), timeout_s=30, what="the slow event to be claimed")

    # A pool process SIGKILLed mid-batch; its parent starts another, which takes the rescued events.
    doomed = worker_factory(settings, concurrency=2, label="doomed")
    ids = slow_events(kit, 8, sleep_s=0.5, tag="child")
    held = wake_until_held(kit, waker, ids, doomed, "the doomed worker to hold events")
    victim = next(iter(held.values()))
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    child_held = {evt_id for evt_id, pid in held.items() if pid == victim}
    wait_processed(kit, ids, timeout_s=90)
    child_s = time.monotonic() - killed_at

    # The whole pool, parent and children, SIGKILLed mid-batch; another worker takes over.
    doomed_pool = worker_factory(settings, concurrency=2, label="pool")
    more = slow_events(kit, 8, sleep_s=0.5, tag="pool")
    pool_held = set(wake_until_held(kit, waker, more, doomed_pool, "the doomed pool to hold events"))
    pids = [doomed_pool.pid, *doomed_pool.children()]
    doomed.kill()                                        # no longer needed: the next events go to the successor
    doomed_pool.kill()
    killed_at = time.monotonic()
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), timeout_s=10, what="the pool to be gone")
    worker_factory(settings, concurrency=2, label="successor")
    wait_processed(kit, more, timeout_s=90)
    pool_s = time.monotonic() - killed_at

    wait_processed(kit, [slow], timeout_s=3 * RESCUE_TARGET_S + 30)
    print(f"\n[{settings.broker_url.split(':')[0]}] child kill: {len(child_held)} held, all processed "
          f"{child_s:.1f} s after; pool kill: {len(pool_held)} held, all processed {pool_s:.1f} s after "
          f"(lease {settings.lease_s} s)")
    assert_once_and_rescued(kit, ids, child_held)
    assert_once_and_rescued(kit, more, pool_held)
    assert [a["outcome"] for a in kit.attempts(slow)] == ["processed"], "the slow handler was taken over"
    assert kit.effects(slow) == 1


def test_a_stopped_worker_keeps_its_lease_until_it_runs_out_and_is_fenced_when_resumed(
        kit, broker_settings, worker_factory, tmp_path):
    settings = dataclasses.replace(broker_settings, lease_s=14, sweep_interval_s=1.0, sweep_overdue_s=1.0)
    sweep = Sweep(env_for(settings), tmp_path).start()
    celery = make_celery(settings, publisher_only=True)
    try:
        waker = Waker(celery)
        stopped = worker_factory(settings, concurrency=1, label="stopped")
        ids = slow_events(kit, 3, sleep_s=2.0, tag="stop")
        held = wake_until_held(kit, waker, ids, stopped, "the worker to hold events")
        claimed_at = time.monotonic()
        pids = [stopped.pid, *stopped.children()]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            worker_factory(settings, concurrency=1, label="other")
            # Several rescue passes later, under its lease: alive to Postgres, never taken over.
            time.sleep(5)
            assert held_by(kit, ids, pids) == held, "a stopped worker's live lease was taken over"
            # Once the lease ran out: taken over, and processed by the other worker.
            wait_processed(kit, ids, timeout_s=60)
            taken_s = time.monotonic() - claimed_at
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        time.sleep(3)                                     # the resumed worker's late attempts end, refused
        print(f"\n[{settings.broker_url.split(':')[0]}] stopped worker held {len(held)}; taken over "
              f"{taken_s:.1f} s after its claim (lease {settings.lease_s} s)")
        assert taken_s >= settings.lease_s - 1
        effects = kit.query("SELECT event_id, count(*) AS n FROM public.test_effects WHERE event_id = ANY(%s) "
                            "GROUP BY event_id", (ids,))
        assert {row["event_id"]: row["n"] for row in effects} == {evt_id: 1 for evt_id in ids}
        for evt_id in held:
            outcomes = [a["outcome"] for a in kit.attempts(evt_id)]
            assert outcomes[-1] == "processed" and outcomes[0] in ("lease_expired", "lease_lost"), outcomes
    finally:
        sweep.kill()
        celery.close()
