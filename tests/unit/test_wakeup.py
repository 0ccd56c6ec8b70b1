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
