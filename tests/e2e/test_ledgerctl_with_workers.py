"""ledgerctl against real worker processes: a replay after the fix is deployed, and the sweep re-driving
lost wake-ups. (The same commands in-process: tests/integration/test_replay.py, test_sweep.py.)"""
from __future__ import annotations

import dataclasses
import json
import time

import pytest

from devkit.factories import event
from devkit.procs import wait_until
from tests.support.operator import ACTOR, audit
from tests.support.replay_handlers import FIXED_TYPE, MODULE as FIXED_HANDLERS
from tests.support.workers import TEST_HANDLERS, run_ledgerctl
from workers.app import make_celery
from workers.wakeup import Waker
from tests.support.ledger_fixtures import BROKERS

# On Redis and on a RabbitMQ vhost of the test's own.
pytestmark = pytest.mark.parametrize("broker_settings", BROKERS, indirect=True)


def wake(settings, event_id: str) -> None:
    celery = make_celery(settings, publisher_only=True)
    try:
        assert Waker(celery).wake(event_id)
    finally:
        celery.close()


def test_an_event_without_a_handler_replayed_after_the_handler_is_deployed_is_processed_once(
        kit, broker_settings, configured_worker_factory):
    settings = broker_settings
    # No id: the generic mirror cannot keep it, and until the fix no other handler takes the type.
    evt_id = kit.record(event(FIXED_TYPE, {"object": "test_object"}, created=int(time.time())))

    before_fix = configured_worker_factory(settings, label="before-fix")  # the type has no handler yet
    wake(settings, evt_id)
    row = kit.wait_status(evt_id, "failed_permanent")
    assert (row["failure_reason"], row["attempts"]) == ("object_without_id", 1)
    assert kit.effects(evt_id) == 0
    before_fix.kill()

    configured_worker_factory(settings, handler_modules=(TEST_HANDLERS, FIXED_HANDLERS), label="after-fix")
    done = run_ledgerctl(settings, "replay", evt_id, "--why", "fixed")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"replayed {evt_id} (was failed_permanent)"

    row = kit.wait_status(evt_id, "processed")
    assert kit.effects(evt_id) == 1
    assert (row["attempts"], row["attempt_base"], row["failure_reason"], row["last_error"]) == (2, 1, None, None)
    assert [(a["attempt"], a["outcome"], a["error_class"]) for a in kit.attempts(evt_id)] == [
        (1, "failed_permanent", "ObjectWithoutId"), (2, "processed", None)]
    assert kit.attempts(evt_id)[0]["error"].startswith("data.object has no id")
    assert audit(kit, evt_id) == [{"event_id": evt_id, "action": "replay", "actor": ACTOR, "reason": "fixed",
                                   "from_status": "failed_permanent"}]

    shown = run_ledgerctl(settings, "events", "show", evt_id, "--json")
    assert shown.returncode == 0, shown.stderr
    detail = json.loads(shown.stdout)
    assert [(a["attempt"], a["outcome"]) for a in detail["attempts"]] == [(1, "failed_permanent"), (2, "processed")]
    assert [(a["action"], a["actor"], a["reason"]) for a in detail["audit"]] == [("replay", ACTOR, "fixed")]

    # Done is done: without --force a second replay is skipped and nothing runs again.
    again = run_ledgerctl(settings, "replay", evt_id, "--why", "again")
    assert again.returncode == 1 and f"skipped  {evt_id}" in again.stdout
    assert kit.status(evt_id) == "processed" and kit.effects(evt_id) == 1 and len(audit(kit)) == 1


def test_lost_wakeups_are_redriven_by_ledgerctl_sweep_and_processed_by_a_real_worker(
        kit, broker_settings, worker_factory):
    settings = dataclasses.replace(broker_settings, sweep_overdue_s=0.2)
    ids = kit.record_many([event("test.effect", {"id": f"obj_{n}"}, created=int(time.time())) for n in range(5)])
    worker_factory(settings, concurrency=2)  # running, but nobody ever told it about these events
    wait_until(lambda: kit.query("SELECT count(*) AS n FROM ledger.events "
                                 "WHERE wakeup_at < now() - interval '0.2 s'")[0]["n"] == 5,
               what="the wake-ups to be overdue")
    assert all(kit.status(i) == "received" for i in ids)

    done = run_ledgerctl(settings, "sweep", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["redriven"] == 5 and result["skipped_backlog"] is False

    for evt_id in ids:
        row = kit.wait_status(evt_id, "processed", timeout_s=30)
        assert row["attempts"] == 1 and row["redrives"] == 0  # a claim resets the re-drive count
        assert kit.effects(evt_id) == 1
