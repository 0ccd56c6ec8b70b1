"""Sending wake-ups: a message that says only "event X may be ready".

A failed send is never an error for the caller: the event is already durable in
Postgres, and the recovery sweep re-drives any wake-up that did not arrive.

A wake-up costs one Redis command (LPUSH), and no connection, queue declaration
or redis-py client of its own: the Waker keeps the producers it made, each on a
connection of its own, and publishes through them without declaring the queues
again (they are declared once, when a producer is made). The message is Celery's
own ``send_task`` message, routed by the app's task_routes, unchanged.

A producer publishes each task's first wake-up through Celery and kombu, and keeps the
message kombu wrote as that task's template; the next ones it writes itself, the
template with the wake-up's own task id and argument: the same message, for a fraction
of the CPU (Celery's send_task and kombu's publish around one write cost more than the
write). On Redis the message is LPUSHed to the same key (its delivery tag new too;
tests/unit/test_wakeup.py compares the two messages); on RabbitMQ it is published on the
same channel, to the same exchange and routing key, and its confirm waited for as
kombu waits for it (374 µs of CPU a wake-up through Celery, against about 60;
tests/integration/test_wakeup_rabbitmq.py compares the two messages). A wake-up with a
countdown always goes Celery's way.

Not Celery's pooled producers: that pool is kombu's, process-wide, shared by every
app on the same broker URL and limited to broker_pool_limit; producers kept from it
for life hold its slots for good, and Wakers dropped without ``close()`` (ledgerctl,
tests, benchmarks make many) would exhaust it.
"""
from __future__ import annotations

import base64
import copy
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Sequence

import amqp
from celery import Celery
from celery.utils.saferepr import saferepr
from kombu import Connection, Producer
from kombu.utils.json import dumps, loads

from workers.app import DISPATCH_EFFECT_TASK, EVENT_BATCH_MAX, PROCESS_EVENT_TASK, is_amqp
from workers.grouping import Grouping

log = logging.getLogger(__name__)


@dataclass
class _Template:
    """A wake-up message as kombu's Redis transport wrote it (the JSON it LPUSHes), and its key."""
    key: str
    message: dict
    _call_rest: tuple = field(init=False, repr=False)  # the body's kwargs and embed, the same for every wake-up

    def __post_init__(self):
        _args, kwargs, embed = loads(base64.b64decode(self.message["body"]))
        self._call_rest = (kwargs, embed)

    def fill(self, arg) -> str:
        """The same message for another wake-up of the task: its own task id, argument and delivery tag.
        Only the two dicts it changes are copied: the rest of the template is shared, never changed."""
        task_id = str(uuid.uuid4())
        headers = {**self.message["headers"], "id": task_id, "root_id": task_id, "argsrepr": saferepr([arg])}
        properties = {**self.message["properties"], "correlation_id": task_id, "delivery_tag": str(uuid.uuid4())}
        body = base64.b64encode(dumps([[arg], *self._call_rest]).encode()).decode()
        return dumps({**self.message, "body": body, "headers": headers, "properties": properties})


@dataclass
class _AmqpTemplate:
    """A wake-up message as kombu's py-amqp transport published it: its body and properties (Celery's headers
    among them), and where it went."""
    message: amqp.Message
    publish: dict  # exchange, routing_key, mandatory, immediate
    _call_rest: tuple = field(init=False, repr=False)

    def __post_init__(self):
        _args, kwargs, embed = loads(self.message.body)
        self._call_rest = (kwargs, embed)

    def fill(self, arg) -> amqp.Message:
        """The same message for another wake-up of the task: its own task id and argument."""
        task_id = str(uuid.uuid4())
        properties = dict(self.message.properties)
        properties["application_headers"] = {**properties["application_headers"], "id": task_id, "root_id": task_id,
                                              "argsrepr": saferepr([arg])}
        properties["correlation_id"] = task_id
        return amqp.Message(dumps([[arg], *self._call_rest]).encode(), **properties)


@dataclass
class _Publisher:
    connection: Connection
    producer: Producer
    # By task name: the message of the task's first wake-up (see the module's docstring).
    templates: dict[str, _Template | _AmqpTemplate] = field(default_factory=dict)
    confirms: bool = False

    def publish(self, celery: Celery, task: str, arg, countdown_s: float | None) -> None:
        # On RabbitMQ (publisher confirms: workers/app.py) the ack is waited for BROKER_TIMEOUT_S at most.
        confirm = {"confirm_timeout": celery.conf.broker_connection_timeout} if self.confirms else {}
        template = self.templates.get(task) if countdown_s is None else None
        channel = self.producer.channel
        if isinstance(template, _AmqpTemplate):
            channel.basic_publish(template.fill(arg), **template.publish, **confirm)
            return
        if template is not None:
            with channel.conn_or_acquire() as client:
                client.lpush(template.key, template.fill(arg))
            return
        captured: list[_Template | _AmqpTemplate] = []
        redis_put = countdown_s is None and hasattr(channel, "on_put")
        amqp_publish = countdown_s is None and not redis_put and isinstance(channel, amqp.Channel)
        if redis_put:
            channel.on_put = lambda key, message: captured.append(_Template(key, copy.deepcopy(message)))
        elif amqp_publish:
            real = channel.basic_publish

            def spy(message, *args, **kwargs):
                where = {k: kwargs[k] for k in ("exchange", "routing_key", "mandatory", "immediate") if k in kwargs}
                captured.append(_AmqpTemplate(copy.deepcopy(message), where))
                return real(message, *args, **kwargs)
            channel.basic_publish = spy
        try:
            celery.send_task(task, args=[arg], countdown=countdown_s, retry=False, producer=self.producer,
                             declare=[], **confirm)
        finally:
            if redis_put:
                channel.on_put = None
            elif amqp_publish:
                channel.basic_publish = real
        if len(captured) == 1 and _is_plain(captured[0], arg):
            self.templates[task] = captured[0]

    def close(self) -> None:
        # Dropped without the closing handshake: a broker that stopped answering (RabbitMQ blocks a
        # publishing connection during a memory alarm) would never answer it, and the caller (the
        # receiver, its answer to Stripe) would wait for good.
        try:
            self.connection.collect()
        except Exception:  # a broken connection may fail to close; it is dropped all the same
            pass


class Waker:
    """Publishes wake-ups through producers it keeps, one per concurrent caller.

    A publish takes an idle producer (or makes one, at the first wake-up) and puts it back after; so a
    process that publishes from one thread at a time (a sync gunicorn worker, a Celery pool process,
    the sweep) has one, and gthread's threads never wait on each other, not even while a broker that is
    down makes each of them wait BROKER_TIMEOUT_S. A producer whose publish failed (the broker went
    away, a connection broke) is closed, not put back: the next wake-up makes a new one, so a broker
    that comes back is used again without a restart. A forked child (gunicorn forks its workers) never
    uses its parent's: it forgets them, without closing what is the parent's.
    """

    def __init__(self, celery: Celery):
        self._celery = celery
        self._lock = threading.Lock()  # for the idle list only, never held while publishing
        self._idle: list[_Publisher] = []
        self._pid = os.getpid()
        self._grouping: Grouping[str, bool] = Grouping(lambda ids: [self.wake_group(ids)] * len(ids),
                                                       max_group=EVENT_BATCH_MAX)

    def wake(self, event_id: str, *, countdown_s: float | None = None) -> bool:
        """Publish one wake-up for an event; True if the broker took it."""
        return self._send(PROCESS_EVENT_TASK, event_id, countdown_s, {"event_id": event_id})

    def wake_together(self, event_id: str) -> bool:
        """Wake a worker for an event, in one message with the events that concurrent callers of this
        process wake meanwhile (workers/grouping.py): a lone caller's goes at once, as ``wake``'s; one that
        arrives while a wake-up is being published goes in the next, with every other that arrived by
        then, up to EVENT_BATCH_MAX. True once the broker took the message that holds it."""
        return self._grouping.submit(event_id)

    def wake_group(self, event_ids: Sequence[str]) -> bool:
        """One wake-up for several events: the id alone for one (the message ``wake`` sends), else the list
        of ids (the worker runs it as that many wake-ups: workers/tasks.py); True if the broker took it."""
        arg = event_ids[0] if len(event_ids) == 1 else list(event_ids)
        return self._send(PROCESS_EVENT_TASK, arg, None, {"wakeups": len(event_ids)})

    def wake_effect(self, outbox_id: int, *, countdown_s: float | None = None) -> bool:
        """Publish one wake-up for a recorded effect; True if the broker took it."""
        return self._send(DISPATCH_EFFECT_TASK, outbox_id, countdown_s, {"outbox_id": outbox_id})

    def _send(self, task: str, arg, countdown_s: float | None, fields: dict) -> bool:
        # A kept producer's connection may have been closed under it (a broker restart, RabbitMQ's
        # heartbeat check on an idle one): that publish is tried once more, on a fresh connection; never
        # after a timeout (see _timed_out).
        for fresh in (False, True):
            publisher = None
            try:
                publisher, made = self._take(fresh=fresh)
                publisher.publish(self._celery, task, arg, countdown_s)
            except Exception as exc:  # any broker or network failure: the sweep recovers it
                if publisher is not None:
                    publisher.close()
                if not fresh and publisher is not None and not made and not _timed_out(exc):
                    continue
                log.warning("wake-up not sent; the sweep will re-drive it",
                            extra={**fields, "error_class": type(exc).__name__})
                return False
            self._put_back(publisher)
            return True
        return False

    def _take(self, *, fresh: bool = False) -> tuple[_Publisher, bool]:
        """An idle producer (False), or a new one (True): always new when ``fresh``."""
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = [], os.getpid()  # the parent's: never used, nor closed, here
            if self._idle and not fresh:
                return self._idle.pop(), False
        return self._make(), True  # outside the lock: connecting may take BROKER_TIMEOUT_S

    def _make(self) -> _Publisher:
        connection = self._celery.connection_for_write()
        try:
            producer = self._celery.amqp.Producer(connection, auto_declare=False)
            for queue in self._celery.amqp.queues.values():
                producer.maybe_declare(queue)
        except BaseException:
            connection.close()
            raise
        return _Publisher(connection, producer, confirms=is_amqp(self._celery.conf.broker_url))

    def _put_back(self, publisher: _Publisher) -> None:
        with self._lock:
            self._idle.append(publisher)

    def close(self) -> None:
        """Close every idle producer's connection (a process that stops publishing); a later wake-up makes one."""
        with self._lock:
            idle, self._idle = self._idle, []
        for publisher in idle:
            publisher.close()

    def ping(self) -> bool:
        """True if the broker accepts a connection now."""
        try:
            with self._celery.connection_for_write() as conn:
                conn.ensure_connection(max_retries=0, timeout=2)
            return True
        except Exception:
            return False


def _timed_out(exc: BaseException) -> bool:
    """A broker that did not answer in time (a timeout of the socket, a confirm, redis-py's own): trying
    again would only double the wait the caller (the receiver's answer) already paid."""
    return isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__


def _is_plain(template: _Template | _AmqpTemplate, arg) -> bool:
    if isinstance(template, _Template):
        return _is_plain_wakeup(template.message, arg)
    message = template.message
    headers = message.properties.get("application_headers") or {}
    try:
        args, kwargs, _embed = loads(message.body)
    except (ValueError, TypeError):
        return False
    return (message.properties.get("content_type") == "application/json" and args == [arg] and not kwargs
            and headers.get("eta") is None and headers.get("expires") is None
            and headers.get("id") == headers.get("root_id") == message.properties.get("correlation_id")
            and headers.get("argsrepr") == saferepr([arg]) and {"exchange", "routing_key"} <= template.publish.keys())


def _is_plain_wakeup(message: dict, arg) -> bool:
    """Whether a message kombu wrote is one ``_Template.fill`` can copy: base64 JSON of a one-argument call
    that runs now (no countdown, no expiry), with the fields fill replaces."""
    headers, properties = message.get("headers") or {}, message.get("properties") or {}
    try:
        args, kwargs, _embed = loads(base64.b64decode(message["body"]))
    except (KeyError, ValueError, TypeError):
        return False
    return (message.get("content-type") == "application/json" and properties.get("body_encoding") == "base64"
            and args == [arg] and not kwargs and headers.get("eta") is None and headers.get("expires") is None
            and headers.get("id") == headers.get("root_id") == properties.get("correlation_id")
            and "delivery_tag" in properties and headers.get("argsrepr") == saferepr([arg]))
