"""Unit tests of the enqueue path (workers.wakeup.Waker) on fakeredis.

kombu's redis transport gets its client from Channel._create_client; it is
pointed at a fakeredis server so the real Celery/kombu publishing code runs.
"""
from __future__ import annotations

import base64
import json

import fakeredis
import kombu.transport.redis
import pytest

from ledger.config import Settings
from workers.app import PROCESS_EVENT_TASK, make_celery
from workers.wakeup import Waker

QUEUE = "stripe-events-under-test"


@pytest.fixture
def fake_server(monkeypatch):
    server = fakeredis.FakeServer()
    monkeypatch.setattr(kombu.transport.redis.Channel, "_create_client",
                        lambda self, asynchronous=False: fakeredis.FakeRedis(server=server))
    return server


@pytest.fixture
def waker(fake_server):
    celery = make_celery(Settings(broker_url="redis://fake-broker:6379/0", queue_name=QUEUE), publisher_only=True)
    yield Waker(celery)
    celery.close()


def _queued(server) -> list[dict]:
    client = fakeredis.FakeRedis(server=server)
    return [json.loads(m) for m in client.lrange(QUEUE, 0, -1)]


def test_wake_publishes_one_message_to_the_configured_queue_for_the_process_event_task(waker, fake_server):
    assert waker.wake("evt_1WakeMeUp") is True

    [message] = _queued(fake_server)
    assert message["headers"]["task"] == PROCESS_EVENT_TASK == "workers.process_event"
    assert message["properties"]["delivery_info"]["routing_key"] == QUEUE
    assert message["content-type"] == "application/json"


def test_the_wakeup_body_carries_only_the_event_id(waker, fake_server):
    waker.wake("evt_1WakeMeUp")

    [message] = _queued(fake_server)
    args, kwargs, _options = json.loads(base64.b64decode(message["body"]))
    assert (args, kwargs) == (["evt_1WakeMeUp"], {})
    assert message["headers"]["eta"] is None


def test_a_wakeup_with_a_countdown_carries_an_eta_and_still_only_the_id(waker, fake_server):
    waker.wake("evt_1Later", countdown_s=30)

    [message] = _queued(fake_server)
    args, kwargs, _options = json.loads(base64.b64decode(message["body"]))
    assert (args, kwargs) == (["evt_1Later"], {})
    assert message["headers"]["eta"] is not None


def test_each_wake_is_one_message(waker, fake_server):
    for event_id in ("evt_a", "evt_b", "evt_a"):
        waker.wake(event_id)

    ids = [json.loads(base64.b64decode(m["body"]))[0][0] for m in _queued(fake_server)]
    assert sorted(ids) == ["evt_a", "evt_a", "evt_b"]


def test_a_broker_failure_returns_false_without_raising(waker, fake_server):
    fake_server.connected = False

    assert waker.wake("evt_1BrokerDown") is False

    fake_server.connected = True
    assert _queued(fake_server) == []


def test_wake_works_again_once_the_broker_is_back(waker, fake_server):
    fake_server.connected = False
    assert waker.wake("evt_1During") is False
    fake_server.connected = True

    assert waker.wake("evt_1After") is True
    assert [json.loads(base64.b64decode(m["body"]))[0] for m in _queued(fake_server)] == [["evt_1After"]]


def test_ping_reports_whether_the_broker_accepts_a_connection(waker, fake_server):
    assert waker.ping() is True
    fake_server.connected = False
    assert waker.ping() is False


def _without_ids(message: dict) -> dict:
    """A message with what differs between two wake-ups of one task blanked: ids, argument, delivery tag."""
    message = json.loads(json.dumps(message))
    message["headers"].update(id=None, root_id=None, argsrepr=None)
    message["properties"].update(correlation_id=None, delivery_tag=None)
    message["body"] = None
    return message


@pytest.mark.parametrize("wake", ["wake", "wake_effect"])
def test_a_wakeup_written_from_the_template_is_the_message_kombu_writes(waker, fake_server, wake):
    """The first wake-up of a task goes through Celery and kombu; the next are written from its message.
    Both must be the same message but for the wake-up's own ids and argument, each decoding to its own
    one-argument call, so a worker cannot tell them apart."""
    send = getattr(waker, wake)
    args = ["evt_1First", "evt_2Second", "evt_3Third"] if wake == "wake" else [11, 12, 13]
    queue = QUEUE if wake == "wake" else f"{QUEUE}.effects"
    for arg in args:
        assert send(arg) is True
    client = fakeredis.FakeRedis(server=fake_server)
    first, *templated = [json.loads(m) for m in reversed(client.lrange(queue, 0, -1))]

    assert len(templated) == 2
    for arg, message in zip(args, [first, *templated]):
        assert _without_ids(message) == _without_ids(first)
        body_args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        assert body_args == [arg] and kwargs == {}
        assert message["headers"]["argsrepr"] == repr([arg])
        assert message["headers"]["id"] == message["headers"]["root_id"] == message["properties"]["correlation_id"]
    ids = {m["headers"]["id"] for m in (first, *templated)}
    tags = {m["properties"]["delivery_tag"] for m in (first, *templated)}
    assert len(ids) == len(tags) == 3


def test_a_countdown_wakeup_never_becomes_a_template(waker, fake_server):
    assert waker.wake("evt_1Later", countdown_s=5) is True
    assert waker.wake("evt_2Now") is True
    assert waker.wake("evt_3Now") is True
    etas = [m["headers"]["eta"] for m in _queued(fake_server)]
    assert sorted(e is None for e in etas) == [False, True, True]


def test_concurrent_wakes_together_share_one_message_and_a_lone_one_goes_at_once(waker, fake_server, monkeypatch):
    """While one wake-up is being published, those that arrive wait for the next message, all together;
    none is answered before the message that holds it was taken."""
    import threading
    import time

    import workers.wakeup

    real = workers.wakeup._Publisher.publish
    first = threading.Event()

    def slow_first(self, celery, task, arg, countdown_s):
        if not first.is_set():
            first.set()
            time.sleep(0.3)  # the others arrive meanwhile
        else:
            time.sleep(0.1)  # long enough for a follower woken too early to answer before it
        return real(self, celery, task, arg, countdown_s)

    monkeypatch.setattr(workers.wakeup._Publisher, "publish", slow_first)
    answers = {}

    def wake(evt_id):
        answers[evt_id] = (waker.wake_together(evt_id), len(_queued(fake_server)))

    lone = threading.Thread(target=wake, args=("evt_lone",))
    lone.start()
    assert first.wait(5)
    others = [threading.Thread(target=wake, args=(f"evt_{n}",)) for n in range(4)]
    for t in others:
        t.start()
    for t in [lone, *others]:
        t.join(10)

    bodies = [json.loads(base64.b64decode(m["body"]))[0][0] for m in reversed(_queued(fake_server))]
    assert bodies[0] == "evt_lone" and sorted(bodies[1]) == [f"evt_{n}" for n in range(4)], bodies
    assert len(bodies) == 2
    # Each answered True only once its message was in the queue.
    assert all(ok and queued >= (1 if evt_id == "evt_lone" else 2) for evt_id, (ok, queued) in answers.items())
