"""A worker SIGKILLed between its business writes and the COMMIT leaves nothing applied; another completes it."""
from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import redis

from devkit.factories import OLD_API, SubscriptionHistory, event
from devkit.procs import pid_alive, wait_until
from workers.app import make_celery
from workers.runtime import Runtime
from workers.wakeup import Waker

LEASE_S = 6  # the minimum Settings accepts; Celery's soft time limit is half of it


@pytest.mark.parametrize("rescue", ["sweep re-drives it", "a direct wake-up after the lease expired"])
def test_a_worker_killed_before_commit_leaves_nothing_and_another_worker_completes_it_once(
        kit, broker_settings, worker_factory, tmp_path, rescue):
    settings = dataclasses.replace(broker_settings, lease_s=LEASE_S, sweep_overdue_s=0.1)
    history = SubscriptionHistory(api_version=OLD_API).lifecycle()
    subscription = history.events[2]["data"]["object"]  # status active
    marker = tmp_path / "in-apply.pid"
    evt = event("test.crash_before_commit", {"id": "obj_crash", "marker": str(marker), "sleep_s": 60,
                                             "subscription": subscription}, created=int(time.time()))
    evt_id = kit.record(evt)
    waker = Waker(make_celery(settings))

    first = worker_factory(settings, concurrency=1, label="doomed")
    assert waker.wake(evt_id)
    pid = int(wait_until(lambda: marker.exists() and marker.read_text(), timeout_s=30,
                         what="the handler to reach the point between its writes and the commit"))
    assert pid in first.children(), "the marker must come from the worker's prefork child"

    # The writes are made but not committed: nobody else sees them.
    assert kit.effects(evt_id) == 0
    assert set(kit.billing_counts().values()) == {0}
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), timeout_s=10, what="the killed child to be gone")
    first.kill()  # the host is gone with it: whoever completes the event is another worker
    # And the broker forgets the message it held (as after a Redis restart): from here on only the
    # rescue under test can wake the event.
    with redis.Redis.from_url(settings.broker_url) as broker:
        broker.flushdb()

    assert kit.effects(evt_id) == 0
    assert set(kit.billing_counts().values()) == {0}
    row = kit.event(evt_id)
    assert row["status"] == "processing" and row["attempts"] == 1
    [attempt] = kit.attempts(evt_id)
    assert attempt["outcome"] == "running" and attempt["worker"].endswith(f":{pid}")

    second = worker_factory(settings, concurrency=1, label="rescuer")
    wait_until(lambda: (lambda r: r["lease_expires_at"] < r["db_now"])(kit.event(evt_id)), timeout_s=30,
               what="the dead worker's lease to expire")
    if rescue == "sweep re-drives it":
        result = Runtime(settings, make_celery(settings)).sweeper.run_once()
        assert result.redriven == 1 and not result.skipped_backlog
    else:
        assert waker.wake(evt_id)

    row = kit.wait_status(evt_id, "processed", timeout_s=30)
    assert row["attempts"] == 2
    attempts = kit.attempts(evt_id)
    assert [a["outcome"] for a in attempts] == ["lease_expired", "processed"]
    assert attempts[0]["error_class"] == "LeaseExpired"
    assert attempts[1]["worker"] != attempts[0]["worker"]
    assert int(attempts[1]["worker"].rsplit(":", 1)[1]) in second.children()
    assert kit.effects(evt_id) == 1
    [sub] = kit.query("SELECT status, source_event_id FROM billing.subscriptions")
    assert sub == {"status": "active", "source_event_id": evt_id}
    assert kit.query("SELECT event_id, applied FROM billing.subscription_transitions") == [
        {"event_id": evt_id, "applied": True}]
    assert kit.query("SELECT feature FROM billing.entitlements ORDER BY feature") == [
        {"feature": "reports"}, {"feature": "seats"}]
