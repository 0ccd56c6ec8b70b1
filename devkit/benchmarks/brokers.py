"""The brokers the stack is measured on (``ops/bench --broker redis|amqp|both``).

``redis``: the benchmark's private ``redis-server`` (the default, as docs/configuration.md runs the stack).
``amqp``: RabbitMQ, the machine's own server (127.0.0.1:5672), on a vhost of the run's own
(``devkit.servers.RabbitVhost``: created at the start, dropped at the end), so no other
user's queue or message meets the run's. The project reads its broker from
``CELERY_BROKER_URL`` alone; the benchmark sets it per run, for every process of the stack.

Besides the URL, what differs per broker is how the benchmark itself empties a queue, puts
a backlog's wake-ups in it, counts the broker's commands (Redis only: ``INFO commandstats``)
and which process's CPU is the broker's (RabbitMQ's is the machine's shared server: other
users' traffic on other vhosts counts too).
"""
from __future__ import annotations

from pathlib import Path

from devkit.servers import purge_amqp_queues

BROKERS = ("redis", "amqp")
LABELS = {"redis": "Redis", "amqp": "RabbitMQ"}


def choices(option: str) -> tuple[str, ...]:
    """``--broker`` as the brokers to run, in order."""
    return BROKERS if option == "both" else (option,)


def purge(broker: str, url: str, queue: str) -> None:
    """Every wake-up waiting in ``queue`` dropped (Redis: its list and kombu's unacked bookkeeping)."""
    if broker == "redis":
        from .workload import drop_queue

        drop_queue(url, queue)
        return
    purge_amqp_queues(url, [queue])


def push_wakeups(broker: str, url: str, queue: str, event_ids: list[str]) -> None:
    """One wake-up per id, in order, as the product publishes them (Redis: pipelined LPUSHes of the
    very message Waker.wake sends; RabbitMQ: Waker.wake itself, one publish each)."""
    if broker == "redis":
        from .workload import push_wakeups as push

        push(url, queue, event_ids)
        return
    from ledger.config import Settings
    from workers.app import make_celery
    from workers.wakeup import Waker

    app = make_celery(Settings(broker_url=url, queue_name=queue), publisher_only=True)
    waker = Waker(app)
    try:
        for event_id in event_ids:
            if not waker.wake(event_id):
                raise RuntimeError(f"could not publish a wake-up to RabbitMQ ({url.rsplit('@', 1)[-1]})")
    finally:
        waker.close()
        app.close()


def commands(broker: str, url: str) -> dict[str, int]:
    """Commands the broker ran so far by name (Redis); empty for RabbitMQ (no such counter)."""
    if broker != "redis":
        return {}
    from .workload import redis_commands

    return redis_commands(url)


def rabbitmq_pid() -> int | None:
    """The RabbitMQ server's Erlang VM (beam.smp running the rabbit application), if any."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "beam.smp":
                continue
            if b"rabbit" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except OSError:
            continue
    return None
