"""Two workers handed the same event id at the same instant apply it once."""
from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest

from devkit.factories import event
from workers.app import make_celery
from workers.processor import Outcome
from workers.wakeup import Waker
from tests.support.workers import run_threads, wait_for

ROUNDS = 30


def test_two_threads_processing_the_same_id_at_once_apply_it_exactly_once(kit):
    ids = kit.record_many([event("test.effect", {"id": f"obj_{n}"}, created=int(time.time()))
                           for n in range(ROUNDS)])
    processors = [kit.processor(name=f"racer-{n}") for n in range(2)]  # a pool (own connections) each
    barrier = threading.Barrier(2)
    outcomes: dict[str, list[Outcome]] = {evt_id: [] for evt_id in ids}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def race(processor):
        try:
            for evt_id in ids:
                barrier.wait(timeout=30)
                outcome = processor.process(evt_id)
                with lock:
                    outcomes[evt_id].append(outcome)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    run_threads(race, [(p,) for p in processors])
    assert not errors, errors

    for evt_id in ids:
        assert sorted(outcomes[evt_id]) == sorted([Outcome.PROCESSED, Outcome.NOT_CLAIMED]), (evt_id, outcomes[evt_id])
        assert kit.effects(evt_id) == 1, evt_id
        row = kit.event(evt_id)
        assert row["status"] == "processed" and row["attempts"] == 1
    assert kit.effects() == ROUNDS


def _task_results(workers) -> Counter:
    """What each handled wake-up returned, from the workers' JSON logs."""
    results = Counter()
    for worker in workers:
        for line in worker.log().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("name") == "celery.app.trace" and "succeeded" in record.get("message", ""):
                results[record["data"]["return_value"].strip("'")] += 1
    return results


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["one worker with two child processes", "two worker processes"])
def test_ten_wakeups_of_one_id_to_real_workers_apply_it_once(kit, broker_settings, worker_factory, layout):
    if layout == "one worker with two child processes":
        workers = [worker_factory(broker_settings, concurrency=2, label="pair")]
    else:
        workers = [worker_factory(broker_settings, concurrency=1, label=f"solo{n}", ready=False) for n in range(2)]
        for worker in workers:
            worker.wait_ready()
    # The handler lingers a little after its write so the other process's copies arrive mid-apply.
    evt_id = kit.record(event("test.effect", {"id": "obj_dup", "sleep_s": 0.3}, created=int(time.time())))
    waker = Waker(make_celery(broker_settings))
    assert all(waker.wake(evt_id) for _ in range(10))

    def all_handled():
        results = _task_results(workers)
        return results if sum(results.values()) >= 10 else None

    results = wait_for(all_handled, timeout_s=60, what="all ten wake-ups to be handled")
    assert results == Counter({"processed": 1, "not_claimed": 9})
    row = kit.event(evt_id)
    assert row["status"] == "processed" and row["attempts"] == 1
    assert kit.effects(evt_id) == 1
    assert [a["outcome"] for a in kit.attempts(evt_id)] == ["processed"]
