"""The brokers the stack is measured on (``--broker redis|amqp|both``): the private redis-server, or the machine's
RabbitMQ on a vhost of the run's own; how the bench empties and fills a queue, counts commands and finds the CPU."""
from __future__ import annotations

import contextlib
from pathlib import Path

import redis

from devkit.servers import purge_amqp_queues
from ledger.config import Settings
from workers.app import make_celery
from workers.wakeup import Waker

from . import workload

BROKERS = ("redis", "amqp")
LABELS = {"redis": "Redis", "amqp": "RabbitMQ"}


def choices(option: str) -> tuple[str, ...]:
    return BROKERS if option == "both" else (option,)


def purge(broker: str, url: str, queue: str) -> None:
    """Every wake-up waiting in ``queue`` dropped (Redis: its list and kombu's unacked bookkeeping)."""
    if broker == "redis":
        with redis.Redis.from_url(url) as client:
            client.delete(queue, "unacked", "unacked_index")
    else:
        purge_amqp_queues(url, [queue])


def push_wakeups(broker: str, url: str, queue: str, event_ids: list[str]) -> None:
    """One wake-up per id, in order, as Waker.wake publishes them (Redis: its message, LPUSHed in pipelines)."""
    if broker == "redis":
        workload.push_wakeups(url, queue, event_ids)
        return
    with (contextlib.closing(make_celery(Settings(broker_url=url, queue_name=queue), publisher_only=True)) as app,
          contextlib.closing(Waker(app)) as waker):
        if not all(map(waker.wake, event_ids)):
            raise RuntimeError(f"could not publish a wake-up to RabbitMQ ({url.rsplit('@', 1)[-1]})")


def commands(broker: str, url: str) -> dict[str, int]:
    """Commands the broker ran so far by name (Redis); empty for RabbitMQ (no such counter)."""
    if broker != "redis":
        return {}
    with redis.Redis.from_url(url) as client:
        return {k.removeprefix("cmdstat_"): v["calls"] for k, v in client.info("commandstats").items()}


def rabbitmq_pid() -> int | None:
    """The RabbitMQ server's Erlang VM (beam.smp running the rabbit application), if any."""
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if comm.read_text().strip() == "beam.smp" and b"rabbit" in (comm.parent / "cmdline").read_bytes():
                return int(comm.parent.name)
    return None
