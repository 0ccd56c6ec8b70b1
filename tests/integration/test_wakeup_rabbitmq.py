"""Wake-ups on RabbitMQ, on a vhost of the test's own: publisher confirms make a wake-up the broker
refused count as not sent (the sweep's to re-drive), and the queue depth the sweep, ``ledgerctl stats``
and the broker_queue_depth gauge read is the broker's, on RabbitMQ as on Redis."""
from __future__ import annotations

import json
import time
import uuid

import pytest

from devkit.servers import RabbitVhost
from ledger.config import Settings
from workers.app import make_celery
from workers.sweep import queue_depth
from workers.wakeup import Waker

NO_RABBITMQ = "no RabbitMQ on 127.0.0.1:5672 that rabbitmqctl can manage"


@pytest.fixture
def vhost():
    if not RabbitVhost.available():
        pytest.skip(NO_RABBITMQ)
    with RabbitVhost(f"wakeups-{uuid.uuid4().hex[:8]}") as made:
        yield made


def waker_on(vhost: RabbitVhost, **settings) -> tuple[Waker, Settings]:
    config = Settings(broker_url=vhost.url, queue_name=f"q-{uuid.uuid4().hex[:8]}", **settings)
    return Waker(make_celery(config, publisher_only=True)), config


def test_a_wake_up_rabbitmq_takes_is_sent_and_counted_in_the_queue_depth(vhost):
    waker, config = waker_on(vhost)
    try:
        assert [waker.wake(f"evt_{n}") for n in range(3)] == [True, True, True]
        assert queue_depth(make_celery(config, publisher_only=True), config.queue_name) == 3
    finally:
        waker.close()


def test_a_wake_up_rabbitmq_refuses_is_not_sent(vhost):
    """A queue at its length limit with overflow=reject-publish nacks the publish. With publisher confirms
    the Waker says so (the sweep re-drives it); without them the wake-up would vanish as "sent"."""
    waker, config = waker_on(vhost)
    try:
        assert waker.wake("evt_first")           # declares the queues
        vhost.ctl("set_policy", "-p", vhost.name, "full", f"^{config.queue_name}$",
                  json.dumps({"max-length": 1, "overflow": "reject-publish"}), "--apply-to", "queues")
        deadline = time.monotonic() + 30
        while waker.wake("evt_refused"):      # the policy takes effect within moments
            assert time.monotonic() < deadline, "RabbitMQ never refused a publish past max-length"
            time.sleep(0.2)
        assert queue_depth(make_celery(config, publisher_only=True), config.queue_name) == 1
    finally:
        waker.close()


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_the_sweeps_queue_depth_gauge_reads_either_broker(request, broker, kit):
    from ledger.operator import OperatorLedger
    from workers.app import effects_queue
    from workers.metrics import LedgerCollector

    if broker == "amqp":
        made = request.getfixturevalue("vhost")
        url = made.url
    else:
        url = request.getfixturevalue("broker_settings").broker_url
    config = Settings(broker_url=url, queue_name=f"q-{uuid.uuid4().hex[:8]}")
    waker = Waker(make_celery(config, publisher_only=True))
    try:
        assert waker.wake("evt_1") and waker.wake("evt_2") and waker.wake_effect(7)
        celery = make_celery(config)
        queues = (config.queue_name, effects_queue(config.queue_name))
        collector = LedgerCollector(OperatorLedger(kit.pool("m")),
                                    queue_depths=lambda: {q: queue_depth(celery, q) for q in queues})
        family = next(f for f in collector.collect() if f.name == "broker_queue_depth")
        assert {s.labels["queue"]: s.value for s in family.samples} == {config.queue_name: 2,
                                                                          effects_queue(config.queue_name): 1}
    finally:
        waker.close()


def test_a_wakeup_written_from_the_template_is_the_message_celery_publishes_on_rabbitmq(vhost):
    """The first wake-up of a task goes through Celery and kombu; the next are published from its message.
    What RabbitMQ delivers must be the same message but for the wake-up's own ids and argument, each
    decoding to its own one-argument call, so a worker cannot tell them apart."""
    import amqp

    waker, config = waker_on(vhost)
    args = ["evt_1First", "evt_2Second", "evt_3Third"]
    try:
        assert [waker.wake(arg) for arg in args] == [True, True, True]
        # The second and third went from the first one's message, not through Celery.
        assert [type(t).__name__ for p in waker._idle for t in p.templates.values()] == ["_AmqpTemplate"]
    finally:
        waker.close()
    host, port = "127.0.0.1", 5672
    with amqp.Connection(f"{host}:{port}", userid="guest", password="guest", virtual_host=vhost.name) as conn:
        channel = conn.channel()
        got = [channel.basic_get(config.queue_name, no_ack=True) for _ in args]
    assert all(message is not None for message in got)

    def without_ids(message) -> dict:
        properties = json.loads(json.dumps(message.properties, default=str))
        properties.pop("delivery_info", None)
        properties["application_headers"].update(id=None, root_id=None, argsrepr=None)
        properties["correlation_id"] = None
        return properties

    first = got[0]
    for arg, message in zip(args, got):
        assert without_ids(message) == without_ids(first)
        body_args, kwargs, _embed = json.loads(message.body)
        assert body_args == [arg] and kwargs == {}
        headers = message.properties["application_headers"]
        assert headers["argsrepr"] == repr([arg])
        assert headers["id"] == headers["root_id"] == message.properties["correlation_id"]
    assert len({m.properties["correlation_id"] for m in got}) == 3
