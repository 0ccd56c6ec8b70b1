"""The Celery app, built from the same Settings as every other process.

The broker only carries wake-ups (an event's id, a receiver's group of them, or an
effect's id); Postgres is the truth. So the settings below favour redelivery over
loss, and a duplicate wake-up costs one failed compare-and-set, nothing more.
"""
from __future__ import annotations

from contextlib import contextmanager
from urllib.parse import urlparse

import kombu.transport.redis
import redis
from celery import Celery
from kombu import Queue

from ledger.config import Settings

PROCESS_EVENT_TASK = "workers.process_event"
DISPATCH_EFFECT_TASK = "workers.dispatch_effect"
# Event wake-ups a worker runs together at most (workers/batching.py): one claim and one
# COMMIT for up to this many events; fewer whenever a pool process is idle.
EVENT_BATCH_MAX = 32

# Redis redelivers an unacked message after this; countdowns must stay well below it
# or a scheduled retry runs twice (see MAX_COUNTDOWN_S).
VISIBILITY_TIMEOUT_S = 3600
MAX_COUNTDOWN_S = 300


def effects_queue(queue: str) -> str:
    """Effect deliveries wait on outside systems: they get a queue of their own, so a
    pool that consumes only the event queue never waits on a slow backend."""
    return f"{queue}.effects"


class _SharedClientRedisChannel(kombu.transport.redis.Channel):
    """kombu's Redis channel, sending its commands through one redis-py client instead of a new one each.

    kombu builds a redis.Redis on the channel's connection pool for every command it sends outside a
    poll: every wake-up published, and on a worker every late ack (HDEL and ZREM of the unacked
    message), paid for building one (about 130 µs: its response-callback table). A client holds
    nothing but its pool and is thread-safe: one per channel, per pool, is the same thing. The
    worker's blocking poll (BRPOP) keeps its own client, as kombu has it.
    """

    _shared = None  # (the pool it was built on, the client)
    # Called with (the Redis key, the message) of every message this channel puts, before it is sent:
    # the Waker keeps one as the template of the wake-ups it writes itself (workers/wakeup.py).
    on_put = None

    def _put(self, queue, message, **kwargs):
        if self.on_put is not None:
            self.on_put(self._q_for_pri(queue, self._get_message_priority(message, reverse=False)), message)
        return super()._put(queue, message, **kwargs)

    @contextmanager
    def conn_or_acquire(self, client=None):
        if client:
            yield client
            return
        if self.connection.client is None:
            # The transport was closed under this channel (the worker reconnecting to the broker): a late
            # ack or reject of one of its messages is a connection error, which the consumer logs and gets
            # over, not kombu's AttributeError on the missing URL, which ends the worker. The message
            # comes back to the queue with the connection's other unacked ones.
            raise redis.exceptions.ConnectionError("the channel's broker connection is closed")
        pool = self.pool
        if self._shared is None or self._shared[0] is not pool:  # a closed channel gets a new pool
            self._shared = (pool, self._create_client())
        yield self._shared[1]


class SharedClientRedisTransport(kombu.transport.redis.Transport):
    """kombu's Redis transport with the channel above; messages are kombu's, unchanged."""

    Channel = _SharedClientRedisChannel


AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")


def is_amqp(broker_url: str) -> bool:
    return urlparse(broker_url).scheme in AMQP_SCHEMES


def make_celery(settings: Settings, *, publisher_only: bool = False) -> Celery:
    app = Celery("workers", broker=settings.broker_url, set_as_current=not publisher_only)
    if urlparse(settings.broker_url).scheme == "redis":
        # Only plain redis:// (not rediss://, sentinel://...): the others keep kombu's own transport.
        app.conf.broker_transport = SharedClientRedisTransport
    transport_options = {
        "visibility_timeout": VISIBILITY_TIMEOUT_S,
        "socket_connect_timeout": settings.broker_timeout_s,
        "socket_timeout": settings.broker_timeout_s if publisher_only else 30,
    }
    if publisher_only:
        # The receiver must answer Stripe quickly even when the broker is down:
        # one short try, then the recovery sweep owns the wake-up.
        transport_options["max_retries"] = 0
    if is_amqp(settings.broker_url):
        # Publisher confirms: a wake-up counts as sent only once RabbitMQ took it (a basic.ack), so one
        # it refused or lost is the sweep's, never silently gone. The Waker waits BROKER_TIMEOUT_S at
        # most for the ack (a broker blocked by a memory alarm never acks): then the wake-up is left to
        # the sweep and the receiver answers.
        transport_options["confirm_publish"] = True
    app.conf.update(
        broker_transport_options=transport_options,
        broker_connection_timeout=settings.broker_timeout_s,
        broker_connection_retry_on_startup=True,
        task_default_queue=settings.queue_name,
        # A worker started without -Q consumes both queues; -Q splits them into separate pools.
        task_queues=(Queue(settings.queue_name), Queue(effects_queue(settings.queue_name))),
        task_routes={DISPATCH_EFFECT_TASK: {"queue": effects_queue(settings.queue_name)}},
        # Ack after the task ran: a worker that dies mid-task leaves the message to be redelivered.
        task_acks_late=True,
        # A child killed by a signal or OOM requeues its message instead of acking it.
        task_reject_on_worker_lost=True,
        # Hold one message per pool process, so an idle worker on another host can take the next;
        # event wake-ups held for a batch widen this window themselves (workers/batching.py).
        worker_prefetch_multiplier=1,
        # Messages are plain ids; never unpickle what a broker hands us.
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        # Outcomes live in ledger.attempts, not in a result backend.
        task_ignore_result=True,
        # Bounded: the soft limit fires well before the lease expires, so a stuck
        # attempt fails (recoverably) instead of racing the worker that rescues it.
        task_soft_time_limit=max(1, settings.lease_s // 2),
        task_time_limit=max(2, settings.lease_s * 3 // 4),
        # Publishing a wake-up is fire-and-forget beyond one try.
        task_publish_retry=False,
        # Each worker's remote-control queue (its pidbox: Flower's and `celery inspect`'s) is not exclusive to
        # one connection: a worker whose broker connection broke on its side first (a partition, a proxy in
        # between) reconnects while the broker still holds the old one, and an exclusive queue would refuse
        # it (ResourceLocked), which ends the worker. Auto-deleted with its last consumer all the same.
        control_queue_exclusive=False,
        worker_hijack_root_logger=False,
        worker_send_task_events=settings.task_events,
        task_send_sent_event=False,
    )
    return app
