"""Wake-ups as the receiver publishes them (workers.wakeup.Waker on the publisher-only app: one producer
kept, the queues declared once, one redis-py client), consumed by real ``celery worker`` processes; and
the real receiver (gunicorn) across a restart of its broker.

The message itself against Celery's own: tests/integration/test_wakeup_publish.py.
"""
from __future__ import annotations

import time

import pytest

from devkit.factories import event, sign
from tests.support.constants import WEBHOOK_SECRET
from tests.support.receiver import event_body, event_row, receiver_env
from tests.support.wakeups import publisher_waker, restartable_broker  # noqa: F401


@pytest.fixture
def receivers_waker(broker_settings):
    """The Waker the receiver builds, on this test's queue."""
    with publisher_waker(broker_settings) as waker:
        yield waker


def test_a_real_worker_processes_the_events_the_receivers_waker_wakes_one_of_them_after_its_countdown(
        kit, broker_settings, worker_factory, receivers_waker):
    worker = worker_factory(broker_settings)
    now_ids = [kit.record(event("test.effect", {"id": f"obj_now_{i}"}, created=int(time.time()))) for i in range(5)]
    later_id = kit.record(event("test.effect", {"id": "obj_later"}, created=int(time.time())))

    woken_at = time.monotonic()
    assert receivers_waker.wake(later_id, countdown_s=2) is True
    assert all(receivers_waker.wake(evt_id) for evt_id in now_ids)

    for evt_id in now_ids:
        kit.wait_status(evt_id, "processed", timeout_s=60)
        assert kit.effects(evt_id) == 1
    kit.wait_status(later_id, "processed", timeout_s=60)
    [attempt] = kit.attempts(later_id)
    assert attempt["outcome"] == "processed"
    assert time.monotonic() - woken_at >= 2  # not before its countdown
    assert worker.log().count("workers.process_event") >= 6


def _deliver(receiver) -> dict:
    body = event_body()
    answer = receiver.post(body.encode(), {"Stripe-Signature": sign(body, WEBHOOK_SECRET)})
    assert answer.status_code == 200, receiver.log(3000)
    return answer.json()


@pytest.mark.parametrize("worker_args", [pytest.param({"workers": 2}, id="sync"),
                                         pytest.param({"workers": 2, "threads": 4}, id="gthread")])
def test_with_its_broker_down_the_receiver_answers_at_once_and_after_the_restart_its_next_publish_succeeds(
        db, restartable_broker, start_receiver, worker_args):
    receiver = start_receiver(receiver_env(db, restartable_broker.url, WEBHOOK_SECRET), **worker_args)
    # Every worker process publishes at least once, so each holds its producer when the broker goes.
    before = [_deliver(receiver) for _ in range(8)]
    assert all(a["enqueued"] for a in before), before

    restartable_broker.stop()
    started = time.monotonic()
    down = _deliver(receiver)
    assert (down["outcome"], down["enqueued"]) == ("received", False)
    assert time.monotonic() - started < 5

    restartable_broker.start()
    after = [_deliver(receiver) for _ in range(8)]
    assert all(a["enqueued"] for a in after), (after, receiver.log(3000))
    assert event_row(db, down["event_id"])["status"] == "received"  # the sweep's to re-drive


def test_a_broker_restart_between_two_deliveries_loses_no_wakeup_of_the_receiver(
        db, restartable_broker, start_receiver):
    receiver = start_receiver(receiver_env(db, restartable_broker.url, WEBHOOK_SECRET), workers=1)
    assert _deliver(receiver)["enqueued"] is True

    restartable_broker.restart()

    assert _deliver(receiver)["enqueued"] is True  # on the connection kept from before the restart
