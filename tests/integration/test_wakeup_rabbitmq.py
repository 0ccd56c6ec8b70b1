"""Wake-ups on RabbitMQ, on a vhost of the test's own: publisher confirms make a wake-up the broker
refused count as not sent (the sweep's to re-drive), the queue depth the sweep and ``ledgerctl stats``
read is RabbitMQ's, and a broker that never acks holds the publisher BROKER_TIMEOUT_S at most."""
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

pytestmark = pytest.mark.skipif(not RabbitVhost.available(),
                                reason="no RabbitMQ on 127.0.0.1:5672 that rabbitmqctl can manage")


@pytest.fixture
def vhost():
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
