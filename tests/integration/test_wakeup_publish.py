"""The Waker's publish on a real Redis: the message is exactly Celery's, a forked child never uses its
parent's connection, and a broker that went away is used again as soon as it is back.

Real worker processes consuming it, and the real receiver across a broker restart:
tests/e2e/test_wakeup_publish.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from datetime import datetime

import pytest
import redis

from tests.support.wakeups import publisher_waker, restartable_broker  # noqa: F401
from workers.app import DISPATCH_EFFECT_TASK, PROCESS_EVENT_TASK, effects_queue, make_celery

# What differs between any two messages: their ids, the delivery tag kombu gives each, and reply_to,
# which names the publishing app (and thread).
PER_MESSAGE = {("headers", "id"), ("headers", "root_id"), ("properties", "correlation_id"),
               ("properties", "delivery_tag"), ("properties", "reply_to")}


def _without_ids(raw: bytes) -> dict:
    message = json.loads(raw)
    for part, key in PER_MESSAGE:
        message[part].pop(key)
    return message


@pytest.fixture
def publisher(broker_settings):
    """The receiver's Waker on this test's queue."""
    with publisher_waker(broker_settings) as waker:
        yield waker


def test_a_wakeup_is_byte_for_byte_the_message_celerys_own_send_task_publishes(broker_settings, publisher):
    queue = broker_settings.queue_name
    plain = make_celery(broker_settings)  # kombu's own transport, Celery's default publish
    try:
        with redis.Redis.from_url(broker_settings.broker_url) as client:
            for task, arg, countdown, name in ((PROCESS_EVENT_TASK, "evt_same", None, queue),
                                               (PROCESS_EVENT_TASK, "evt_later", 30, queue),
                                               (DISPATCH_EFFECT_TASK, 7, None, effects_queue(queue))):
                plain.send_task(task, args=[arg], countdown=countdown, retry=False)
                celerys = client.rpop(name)
                send = publisher.wake_effect if task == DISPATCH_EFFECT_TASK else publisher.wake
                assert send(arg, countdown_s=countdown) is True
                ours = client.rpop(name)

                theirs, mine = _without_ids(celerys), _without_ids(ours)
                if countdown:  # an ETA is now + countdown: the two were made a moment apart
                    assert abs(_eta(theirs) - _eta(mine)) < 5
                    theirs["headers"].pop("eta"), mine["headers"].pop("eta")
                assert mine == theirs
    finally:
        plain.close()


def _eta(message: dict) -> float:
    return datetime.fromisoformat(message["headers"]["eta"]).timestamp()


def test_a_forked_child_publishes_on_a_connection_of_its_own_and_leaves_the_parents_working(
        broker_settings, publisher):
    queue = broker_settings.queue_name
    assert publisher.wake("evt_parent_before") is True
    [parents] = publisher._idle

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        ok = publisher.wake("evt_child") and [p.connection for p in publisher._idle] != [parents.connection]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)

    assert os.waitstatus_to_exitcode(status) == 0
    assert publisher.wake("evt_parent_after") is True
    assert publisher._idle == [parents]  # the child's exit closed nothing of the parent's
    with redis.Redis.from_url(broker_settings.broker_url) as client:
        ids = sorted(json.loads(m)["headers"]["argsrepr"] for m in client.lrange(queue, 0, -1))
    assert ids == sorted(repr([i]) for i in ("evt_parent_before", "evt_child", "evt_parent_after"))


def test_a_broker_that_goes_away_costs_a_quick_false_and_is_used_again_as_soon_as_it_is_back(
        broker_settings, restartable_broker):
    settings = dataclasses.replace(broker_settings, broker_url=restartable_broker.url)
    with publisher_waker(settings) as waker:
        assert waker.wake("evt_before") is True

        restartable_broker.stop()
        started = time.monotonic()
        assert waker.wake("evt_while_down") is False
        assert time.monotonic() - started < settings.broker_timeout_s + 0.5

        restartable_broker.start()
        assert waker.wake("evt_after") is True  # the first try after the restart
        with redis.Redis.from_url(restartable_broker.url) as client:
            assert [json.loads(m)["headers"]["argsrepr"] for m in client.lrange(settings.queue_name, 0, -1)] == [
                repr(["evt_after"])]


def test_a_restart_between_two_wakeups_loses_neither(broker_settings, restartable_broker):
    # The connection kept since the first wake-up is stale after the restart: the next one must not pay for it.
    settings = dataclasses.replace(broker_settings, broker_url=restartable_broker.url)
    with publisher_waker(settings) as waker:
        assert waker.wake("evt_before") is True
        restartable_broker.restart()

        assert waker.wake("evt_after") is True
