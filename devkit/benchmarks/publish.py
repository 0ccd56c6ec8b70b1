"""What one wake-up costs its publisher: ``ops/devkit-run devkit.benchmarks.publish [--n 5000]``.

Times ``--n`` wake-ups, one at a time as the receiver sends them, against a private Redis
(devkit.servers.PrivateRedis), and counts per publish the Redis commands (``INFO commandstats``
after ``CONFIG RESETSTAT``) and the redis-py clients built, and in all the connections opened. Next to ``workers.wakeup.Waker`` (what the receiver, the workers and
the sweep use): Celery's ``send_task`` as Celery does it by default and with the options the Waker
may use, and the floor, a raw redis-py ``LPUSH`` of a message of the same size on a client kept
open. Prints numbers; asserts nothing; not part of the test suite (tests/e2e/test_wakeup_publish.py
checks what the message is and that a worker consumes it).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Callable

import redis

from devkit.servers import PrivateRedis
from ledger.config import Settings
from workers.app import PROCESS_EVENT_TASK, make_celery
from workers.wakeup import Waker

QUEUE = "bench-publish"
WARM_UP = 200
# Commands the measurement itself sends, not counted.
OWN_COMMANDS = {"info", "config", "del", "llen", "lrange", "rpop"}


def _event_id(i: int) -> str:
    return f"evt_bench_{i:024d}"


def _commands(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()
            if k.removeprefix("cmdstat_").split("|")[0] not in OWN_COMMANDS}


class ClientCount:
    """How many redis.Redis clients are built while it is on (kombu's Redis channel builds its own)."""

    def __init__(self):
        self.built = 0
        self._init = None

    def __enter__(self) -> "ClientCount":
        self._init = init = redis.Redis.__init__

        def counting_init(client, *args, **kwargs):
            self.built += 1
            init(client, *args, **kwargs)
        redis.Redis.__init__ = counting_init
        return self

    def __exit__(self, *exc) -> None:
        redis.Redis.__init__ = self._init


def _connections(client: redis.Redis) -> int:
    return client.info("stats")["total_connections_received"]


def measure(label: str, publish: Callable[[int], object], client: redis.Redis, n: int) -> dict:
    for i in range(WARM_UP):
        publish(i)
    client.delete(QUEUE)
    client.config_resetstat()
    connections = _connections(client)
    timings = []
    with ClientCount() as clients:
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(n):
            t0 = time.perf_counter_ns()
            publish(WARM_UP + i)
            timings.append(time.perf_counter_ns() - t0)
        total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    commands = _commands(client)
    connections = _connections(client) - connections
    queued = client.llen(QUEUE)
    client.delete(QUEUE)
    timings.sort()
    return {
        "label": label,
        "mean_us": total / n * 1e6,
        "cpu_us": cpu / n * 1e6,
        "p50_us": timings[n // 2] / 1e3,
        "p99_us": timings[min(n - 1, n * 99 // 100)] / 1e3,
        "commands_per_publish": sum(commands.values()) / n,
        "commands": {name: round(calls / n, 2) for name, calls in sorted(commands.items())},
        "clients_per_publish": clients.built / n,
        "connections": connections,
        "queued": queued,
    }


def run(n: int) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-publish-"))
    server = PrivateRedis(tmp / "redis.log").start()
    client = redis.Redis.from_url(server.url)
    results = []
    try:
        settings = Settings(broker_url=server.url, queue_name=QUEUE)
        celery = make_celery(settings, publisher_only=True)
        waker = Waker(celery)
        if not waker.wake(_event_id(0)):
            raise RuntimeError("the Waker could not publish to the private Redis")
        template = client.rpop(QUEUE)  # a real wake-up, for the LPUSH floor's message size
        # The same app on kombu's own Redis transport (a new redis-py client per command).
        stock = make_celery(settings, publisher_only=True)
        stock.conf.broker_transport = "redis"

        def send(app, i, **options):
            return app.send_task(PROCESS_EVENT_TASK, args=[_event_id(i)], retry=False, **options)

        results.append(measure("Waker.wake (the receiver's publish)", lambda i: waker.wake(_event_id(i)),
                               client, n))
        results.append(measure("send_task, pool per publish, kombu's transport (Waker before)",
                               lambda i: send(stock, i), client, n))
        with stock.producer_pool.acquire(block=True) as producer:
            results.append(measure("send_task, one producer held, kombu's transport",
                                   lambda i: send(stock, i, producer=producer), client, n))
            results.append(measure("send_task, one producer held, declare=[], kombu's transport",
                                   lambda i: send(stock, i, producer=producer, declare=[]), client, n))
        results.append(measure("send_task, pool per publish, the publisher's transport",
                               lambda i: send(celery, i), client, n))
        results.append(measure(f"raw LPUSH of {len(template)} bytes, one redis-py client",
                               lambda i: client.lpush(QUEUE, template), client, n))
        waker.close()
        stock.close()
        celery.close()
    finally:
        client.close()
        server.stop()
    return results


def report(results: list[dict], n: int) -> str:
    lines = [f"{n} publishes each, one at a time, to a private Redis on 127.0.0.1 (after {WARM_UP} warm-up)",
             f"{'publish':62} {'mean µs':>8} {'p50 µs':>7} {'p99 µs':>7} {'CPU µs':>7} {'cmds':>5} {'clients':>7}"
             f" {'conns':>5}  commands per publish"]
    for r in results:
        lines.append(f"{r['label']:62} {r['mean_us']:8.0f} {r['p50_us']:7.0f} {r['p99_us']:7.0f} {r['cpu_us']:7.0f} "
                     f"{r['commands_per_publish']:5.2f} {r['clients_per_publish']:7.2f} {r['connections']:5d}  "
                     + " ".join(f"{name}={calls:g}" for name, calls in r["commands"].items())
                     + ("" if r["queued"] == n else f"  (queued {r['queued']} of {n}!)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=5000, help="publishes per measurement (default 5000)")
    args = parser.parse_args(argv)
    print(report(run(args.n), args.n))


if __name__ == "__main__":
    main()
