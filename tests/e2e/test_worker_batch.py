"""Real ``celery worker`` processes run the event wake-ups they hold in batches (workers/batching.py): a
backlog drains in batches, each event still attempted once; a lone wake-up is not held back. What one
batch does in Postgres: tests/integration/test_worker_batch.py."""
from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from devkit.factories import event
from devkit.procs import wait_until
from workers.app import EVENT_BATCH_MAX, make_celery
from workers.batching import MAX_HOLD_S
from workers.wakeup import Waker
from tests.support.ledger_fixtures import BROKERS

# On Redis and on a RabbitMQ vhost of the test's own.
pytestmark = pytest.mark.parametrize("broker_settings", BROKERS, indirect=True)

BACKLOG = 150


def _records(worker, name: str) -> list[dict]:
    records = []
    for line in worker.log().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("name") == name:
            records.append(record)
    return records


def _batches(worker) -> list[dict]:
    return [r for r in _records(worker, "workers.batching") if r.get("message") == "batch ran"]


def test_a_backlog_drains_in_batches_and_every_event_is_applied_once(kit, broker_settings, worker_factory):
    now = int(time.time())
    # Each event takes a few ms more than fetching its wake-up does, so batches gather on any machine.
    ids = kit.record_many([event("test.effect", {"id": f"obj_{n}", "sleep_s": 0.005}, created=now)
                           for n in range(BACKLOG)])
    [rejected] = kit.record_many([event("test.permanent", {"id": "obj_rejected"}, created=now)])
    [flaky] = kit.record_many([event("test.flaky", {"id": "obj_flaky", "succeed_on_attempt": 2}, created=now)])
    waker = Waker(make_celery(broker_settings))
    # The backlog is in the queue before any worker runs; a few wake-ups arrive twice.
    wakeups = [*ids[:75], rejected, flaky, *ids[75:], *ids[:5]]
    assert all(waker.wake(evt_id) for evt_id in wakeups)

    worker = worker_factory(broker_settings, concurrency=2, label="drain")
    for evt_id in ids:
        kit.wait_status(evt_id, "processed", timeout_s=120)
    kit.wait_status(rejected, "failed_permanent", timeout_s=30)
    kit.wait_status(flaky, "processed", timeout_s=60)  # its retry (a countdown wake-up) ran on its own

    for evt_id in ids:
        assert kit.effects(evt_id) == 1 and kit.event(evt_id)["attempts"] == 1, evt_id
    assert kit.effects(rejected) == 0
    assert [a["outcome"] for a in kit.attempts(flaky)] == ["failed_recoverable", "processed"]
    assert kit.effects() == BACKLOG + 1

    batches = wait_until(lambda: (lambda b: b if sum(x["wakeups"] for x in b) >= len(wakeups) else None)(
        _batches(worker)), timeout_s=30, what="every held wake-up's batch to be logged")
    sizes = [b["wakeups"] for b in batches]
    assert sum(sizes) == len(wakeups)  # every message held went through a batch (the retry's did not)
    assert max(sizes) > 1 and len(sizes) < len(wakeups) / 2, sizes
    assert max(sizes) <= EVENT_BATCH_MAX
    outcomes = Counter(r["outcome"] for r in _records(worker, "workers.processor") if "outcome" in r)
    assert outcomes == Counter({"processed": BACKLOG + 1, "not_claimed": 5, "failed_permanent": 1,
                                "failed_recoverable": 1}), outcomes
    # The retry's wake-up carried a countdown: Celery ran it as one task, not in a batch.
    assert any(r.get("message", "").startswith("Task workers.process_event[") and "succeeded" in r["message"]
               for r in _records(worker, "celery.app.trace"))


def test_a_wakeup_naming_several_events_runs_each_once(kit, broker_settings, worker_factory):
    """A receiver's group (Waker.wake_together): one message, a list of ids; the worker runs them as that
    many wake-ups, and an id named twice is attempted once."""
    now = int(time.time())
    ids = kit.record_many([event("test.effect", {"id": f"obj_group_{n}"}, created=now) for n in range(40)])
    waker = Waker(make_celery(broker_settings))
    assert waker.wake_group(ids[:20]) and waker.wake_group(ids[20:]) and waker.wake_group(ids[:3])

    worker = worker_factory(broker_settings, concurrency=2, label="groups")
    for evt_id in ids:
        kit.wait_status(evt_id, "processed", timeout_s=60)
    assert all(kit.effects(evt_id) == 1 and kit.event(evt_id)["attempts"] == 1 for evt_id in ids)
    outcomes = wait_until(lambda: (lambda c: c if sum(c.values()) >= 43 else None)(Counter(
        r["outcome"] for r in _records(worker, "workers.processor") if "outcome" in r)), timeout_s=30,
        what="every wake-up's outcome to be logged")
    assert outcomes == Counter({"processed": 40, "not_claimed": 3}), outcomes


def test_a_lone_wakeup_to_an_idle_worker_is_not_held_back(kit, broker_settings, worker_factory):
    worker = worker_factory(broker_settings, concurrency=2, label="idle")
    waker = Waker(make_celery(broker_settings))
    for n in range(3):
        evt_id = kit.record(event("test.effect", {"id": f"obj_lone_{n}"}, created=int(time.time())))
        assert waker.wake(evt_id)
        kit.wait_status(evt_id, "processed", timeout_s=30)
        time.sleep(0.2)  # the worker is idle again before the next one
    batches = wait_until(lambda: (lambda b: b if len(b) >= 3 else None)(_batches(worker)), timeout_s=30,
                         what="the three batches to be logged")
    assert [b["wakeups"] for b in batches] == [1, 1, 1]
    # Handed to a pool process as it arrived: no wait for company (nor for the safeguard's MAX_HOLD_S).
    assert all(b["held_s"] < MAX_HOLD_S / 10 for b in batches), batches


def test_a_worker_whose_processes_are_all_busy_gives_its_wakeups_to_an_idle_one(kit, broker_settings, worker_factory):
    """A handler that runs long (here 40 s, within the soft time limit) keeps its worker's one process busy: the wake-ups that worker takes
    meanwhile go back to the broker after MAX_HOLD_S, and a worker with a free process runs them, long before the
    busy one could."""
    now = int(time.time())
    waker = Waker(make_celery(broker_settings))
    busy = worker_factory(broker_settings, concurrency=1, label="busy")
    # Longer than anything below may take on a loaded machine (a worker's start, a wake-up the sweep re-drives):
    # the busy worker's process stays taken for the whole test, so only the idle worker can have run them.
    [long] = kit.record_many([event("test.effect", {"id": "obj_long", "sleep_s": 40}, created=now)])
    assert waker.wake(long)
    wait_until(lambda: kit.event(long)["status"] == "processing", timeout_s=30, what="the long event to start")
    ids = kit.record_many([event("test.effect", {"id": f"obj_after_{n}"}, created=now) for n in range(6)])
    for evt_id in ids:
        assert waker.wake(evt_id)
    time.sleep(MAX_HOLD_S / 2)                      # the busy worker's consumer has taken them by now
    idle = worker_factory(broker_settings, concurrency=1, label="idle")
    for evt_id in ids:
        kit.wait_status(evt_id, "processed", timeout_s=30)
    assert kit.event(long)["status"] == "processing", "the wake-ups waited for the busy worker"
    ran_on = {int(a["worker"].rsplit(":", 1)[1]) for evt_id in ids for a in kit.attempts(evt_id)}
    assert ran_on <= set(idle.children()), (ran_on, idle.children(), busy.children())
    returned = [r for r in _records(busy, "workers.batching") if r.get("message", "").startswith("wake-ups back")]
    print(f"\n[{broker_settings.broker_url.split(':')[0]}] the busy worker gave back {sum(r['wakeups'] for r in returned)}"
          f" wake-up(s) in {len(returned)} go(es)")
