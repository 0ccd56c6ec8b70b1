"""Two real worker processes (or one with two children) handed the same event id at the same instant apply
it once. Two in-process processors racing for an id: tests/integration/test_worker_processor.py."""
from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from devkit.factories import event
from devkit.procs import wait_until
from workers.app import make_celery
from workers.wakeup import Waker
from tests.support.ledger_fixtures import BROKERS

# On Redis and on a RabbitMQ vhost of the test's own.
pytestmark = pytest.mark.parametrize("broker_settings", BROKERS, indirect=True)


def _task_results(workers) -> Counter:
    """What each handled wake-up came to, from the workers' JSON logs: the processor logs one line with
    its outcome per wake-up, whether the worker ran it alone or in a batch (workers/batching.py)."""
    results = Counter()
    for worker in workers:
        for line in worker.log().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("name") == "workers.processor" and "outcome" in record:
                results[record["outcome"]] += 1
    return results


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

    results = wait_until(all_handled, timeout_s=60, what="all ten wake-ups to be handled")
    assert results == Counter({"processed": 1, "not_claimed": 9})
    row = kit.event(evt_id)
    assert row["status"] == "processed" and row["attempts"] == 1
    assert kit.effects(evt_id) == 1
    assert [a["outcome"] for a in kit.attempts(evt_id)] == ["processed"]
