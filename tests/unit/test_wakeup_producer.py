"""The cheap publish of workers.wakeup.Waker, on fakeredis: producers and their connections kept, the queues
declared once, one redis-py client, the message Celery's own (tests/unit/test_wakeup.py has its shape).

kombu's redis transport gets its clients from Channel._create_client, pointed here at a fakeredis server
(counting how many it builds).
"""
from __future__ import annotations

import base64
import json
import threading
import time

import fakeredis
import kombu.transport.redis
import pytest

from ledger.config import Settings
from workers.app import DISPATCH_EFFECT_TASK, PROCESS_EVENT_TASK, SharedClientRedisTransport, effects_queue, make_celery
from workers.wakeup import Waker

QUEUE = "stripe-events-under-test"


@pytest.fixture
def fake_server():
    return fakeredis.FakeServer()


@pytest.fixture
def clients_built(fake_server, monkeypatch):
    built = []

    def create_client(channel, asynchronous=False):
        built.append(channel)
        return fakeredis.FakeRedis(server=fake_server)
    monkeypatch.setattr(kombu.transport.redis.Channel, "_create_client", create_client)
    return built


@pytest.fixture
def celery(clients_built):
    app = make_celery(Settings(broker_url="redis://fake-broker:6379/0", queue_name=QUEUE), publisher_only=True)
    yield app
    app.close()


@pytest.fixture
def waker(celery):
    waker = Waker(celery)
    yield waker
    waker.close()


def _queued(server, queue: str = QUEUE) -> list[dict]:
    return [json.loads(m) for m in fakeredis.FakeRedis(server=server).lrange(queue, 0, -1)]


def _args(message: dict) -> list:
    return json.loads(base64.b64decode(message["body"]))[0]


def test_plain_redis_apps_use_the_shared_client_transport_and_other_schemes_kombus_own(clients_built):
    settings = Settings(broker_url="redis://fake-broker:6379/0", queue_name=QUEUE)
    publisher, worker = make_celery(settings, publisher_only=True), make_celery(settings)
    tls = make_celery(Settings(broker_url="rediss://fake-broker:6380/0", queue_name=QUEUE))
    try:
        assert publisher.connection_for_write().transport_cls is SharedClientRedisTransport
        assert worker.connection_for_write().transport_cls is SharedClientRedisTransport
        assert tls.connection_for_write().transport_cls == "rediss"
    finally:
        publisher.close()
        worker.close()
        tls.close()


def test_an_effect_wakeup_goes_to_the_effects_queue_and_an_event_wakeup_to_the_event_queue(waker, fake_server):
    assert waker.wake_effect(42) is True
    assert waker.wake("evt_1") is True

    [effect] = _queued(fake_server, effects_queue(QUEUE))
    [event] = _queued(fake_server)
    assert (effect["headers"]["task"], _args(effect)) == (DISPATCH_EFFECT_TASK, [42])
    assert effect["properties"]["delivery_info"]["routing_key"] == effects_queue(QUEUE)
    assert (event["headers"]["task"], _args(event)) == (PROCESS_EVENT_TASK, ["evt_1"])


def test_after_the_first_wakeup_none_makes_a_connection_declares_a_queue_or_builds_a_client(
        waker, celery, fake_server, clients_built, monkeypatch):
    connections, declared = [], []
    connect = celery.connection_for_write
    monkeypatch.setattr(celery, "connection_for_write", lambda *a, **kw: connections.append(1) or connect(*a, **kw))
    maybe_declare = kombu.Producer.maybe_declare
    monkeypatch.setattr(kombu.Producer, "maybe_declare",
                        lambda self, entity, *a, **kw: declared.append(entity.name) or maybe_declare(self, entity, *a, **kw))

    assert waker.wake("evt_first") is True
    assert sorted(declared) == sorted([QUEUE, effects_queue(QUEUE)])  # once, with the producer
    connections.clear(), declared.clear(), clients_built.clear()
    for i in range(50):
        assert waker.wake(f"evt_{i}") is True

    assert len(_queued(fake_server)) == 51
    assert (connections, declared, clients_built) == ([], [], [])


def test_after_a_failed_publish_its_producer_is_closed_and_the_next_wakeup_makes_a_new_one(
        waker, celery, fake_server, monkeypatch):
    assert waker.wake("evt_before") is True
    connections = []
    connect = celery.connection_for_write
    monkeypatch.setattr(celery, "connection_for_write", lambda *a, **kw: connections.append(1) or connect(*a, **kw))
    assert waker.wake("evt_again") is True
    assert connections == []

    fake_server.connected = False
    assert waker.wake("evt_during") is False
    assert len(connections) == 1            # the kept one failed; one try on a fresh connection failed too
    fake_server.connected = True

    assert waker.wake("evt_after") is True
    assert len(connections) == 2
    assert [_args(m) for m in reversed(_queued(fake_server))] == [["evt_before"], ["evt_again"], ["evt_after"]]


def test_a_kept_producer_whose_connection_was_closed_under_it_is_replaced_within_the_same_wake_up(
        waker, fake_server):
    """A broker restart, or RabbitMQ's heartbeat check on an idle connection, closes a kept producer's
    connection: the next wake-up still goes through, on a fresh one, instead of waiting for the sweep."""
    assert waker.wake("evt_before") is True
    fake_server.connected = False
    waker._idle[0].connection.close()
    fake_server.connected = True
    assert waker.wake("evt_after") is True
    assert [_args(m) for m in reversed(_queued(fake_server))] == [["evt_before"], ["evt_after"]]


def test_a_countdown_survives_the_held_producer(waker, fake_server):
    waker.wake("evt_later", countdown_s=30)
    waker.wake("evt_now")

    later, now = reversed(_queued(fake_server))
    assert later["headers"]["eta"] is not None and now["headers"]["eta"] is None


def test_threads_waking_at_once_each_get_their_message_through(waker, fake_server):
    def wake_many(n: int) -> None:
        for i in range(25):
            assert waker.wake(f"evt_{n}_{i}") is True

    threads = [threading.Thread(target=wake_many, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted(_args(m)[0] for m in _queued(fake_server)) == sorted(f"evt_{n}_{i}" for n in range(8)
                                                                      for i in range(25))


def test_close_closes_the_kept_producers_and_a_later_wakeup_makes_one_again(waker, celery, fake_server,
                                                                               monkeypatch):
    waker.wake("evt_0")  # Celery's own first-publish set-up (its event dispatcher) out of the way
    waker.close()
    connections, closed = [], []
    connect = celery.connection_for_write

    def counting_connect(*args, **kwargs):
        connection = connect(*args, **kwargs)
        connections.append(connection)
        # Dropped without the closing handshake (a blocked broker would never answer one): collect().
        collect = connection.collect
        connection.collect = lambda *a, **kw: closed.append(connection) or collect(*a, **kw)
        return connection
    monkeypatch.setattr(celery, "connection_for_write", counting_connect)
    waker.wake("evt_1")
    waker.close()
    assert closed == connections and len(connections) == 1

    assert waker.wake("evt_2") is True
    assert len(connections) == 2 and len(_queued(fake_server)) == 3


def test_wakeups_that_must_connect_at_once_connect_side_by_side_not_one_after_the_other(
        waker, celery, fake_server, monkeypatch):
    waker.wake("evt_warm")  # Celery's own first-publish set-up (its event dispatcher) out of the way
    waker.close()  # nothing kept: both wake-ups below must connect
    connect = celery.connection_for_write
    connections = []

    def slow_connect(*args, **kwargs):
        time.sleep(1.0)  # a broker slow to answer, as one that is down makes each wait BROKER_TIMEOUT_S
        connections.append(1)
        return connect(*args, **kwargs)
    monkeypatch.setattr(celery, "connection_for_write", slow_connect)
    together = threading.Barrier(2)

    def wake(event_id: str) -> None:
        together.wait()
        assert waker.wake(event_id) is True

    started = time.monotonic()
    threads = [threading.Thread(target=wake, args=(f"evt_{n}",)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert time.monotonic() - started < 1.8  # side by side: about one connect, not two
    assert len(connections) == 2 and len(_queued(fake_server)) == 3
