"""The benchmark's own stack, on the toolkit: a private Postgres and Redis, the real receiver and real workers.

``devkit.servers`` and ``devkit.stack`` start them (process groups of their own, on free
ports); ``Bench`` registers each with a ``devkit.procs.Cleanup`` that stops it (also on
Ctrl-C or SIGTERM) and removes the private servers' directories. Nothing here touches
the machine's shared Postgres or Redis. What is the benchmark's own: the server's
settings, the worker fleet, and the per-process accounting (``ProcessWatch``,
``wire_segments``).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from devkit.procs import cpu_seconds, memory_kb, signal_group, wait_until
from devkit.servers import PrivatePostgres
from devkit.stack import DEFAULT_RECEIVER_SERVER, Checkout, ReadmeWorker, Receiver, Sweep, Worker

# Durability as Postgres ships it (fsync and synchronous_commit on): the limit it measures is
# the one production has. pg_stat_statements counts statements; the rest sizes the server
# for the 1M-event history and the benchmark's connections.
POSTGRES_OPTIONS = {"max_connections": "300", "shared_buffers": "1GB",
                    "shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "top",
                    "pg_stat_statements.max": "5000", "track_io_timing": "on", "max_wal_size": "8GB",
                    "checkpoint_timeout": "15min", "maintenance_work_mem": "512MB"}


def bench_postgres() -> PrivatePostgres:
    """The benchmark's server (not started), in a temporary directory that ``destroy()`` removes."""
    return PrivatePostgres(dir=Path(tempfile.mkdtemp(prefix="ledger-bench-pg-")), options=POSTGRES_OPTIONS)


def migrated_database(cleanup, name: str, *, partitioned: bool = False, servers: list | None = None) -> str:
    """A started bench server (destroyed by ``cleanup``; appended to ``servers`` if given, for its CPU)
    holding database ``name`` with the ledger's schema (``partitioned``: then partitioned, as ``ledgerctl
    partitions migrate`` does it); its URL."""
    import psycopg

    from ledger.migrate import migrate

    pg = bench_postgres()
    if servers is not None:
        servers.append(pg)
    cleanup.add("private postgres", pg.destroy)
    pg.init().start()
    with psycopg.connect(pg.url_for("postgres"), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = pg.url_for(name)
    migrate(url)
    if partitioned:
        partition(url)
    return url


def partition(url: str) -> None:
    """The ledger at ``url`` partitioned by month, as ``ledgerctl partitions migrate`` does it."""
    from ledger.config import Settings
    from ledger.db import ProcessPool
    from ledger.partition_migration import PartitionMigration

    pool = ProcessPool(Settings(database_url=url), name="bench-partitions")
    try:
        PartitionMigration(pool).run()
    finally:
        pool.close()


def partition_months(conn, days: float) -> None:
    """On a partitioned ledger, a partition for every month of the last ``days`` (as a migrated ledger has for
    its history; a new one starts at the month 31 days back): made before the rows are written."""
    conn.execute("SELECT ledger.partition_create(m::date) FROM generate_series(date_trunc('month', now() - "
                 "make_interval(days => %(days)s + 1)), date_trunc('month', now()), interval '1 month') m "
                 "WHERE ledger.is_partitioned()", {"days": int(days)})


class WorkerFleet:
    """N ``celery -A workers worker --concurrency 1`` instances: one per "machine" the user adds.

    With ``readme``, each is ``celery -A workers worker --concurrency N`` exactly as docs/configuration.md
    runs it instead (``devkit.stack.ReadmeWorker``: every queue, Celery's own log level);
    ``checkout`` runs another revision's celery (``--compare``).
    """

    def __init__(self, env: Mapping[str, str], log_dir: Path, *, count: int, queue: str, label: str = "w",
                 nice: int = 0, concurrency: int = 1, readme: bool = False, checkout: Checkout = Checkout()):
        self.concurrency = concurrency
        nodes = [f"{label}{index}-{os.getpid()}" for index in range(count)]
        if readme:
            workers = [ReadmeWorker(env, log_dir, concurrency=concurrency, node=node) for node in nodes]
        else:
            workers = [Worker(env, log_dir, queues=(queue,), concurrency=concurrency, node=node, nice=nice)
                       for node in nodes]
        self.workers = [checkout.adopt(worker) for worker in workers]

    def start(self, timeout_s: float = 90) -> "WorkerFleet":
        self.mark_logs()
        for worker in self.workers:
            worker.start()

        def pools_up() -> bool:  # every worker has forked its pool processes
            for worker in self.workers:
                worker.ensure_alive()
            return all(len(worker.children()) >= self.concurrency for worker in self.workers)
        wait_until(pools_up, timeout_s=timeout_s, interval_s=0.1, what="the workers' pool processes")
        return self

    def mark_logs(self) -> None:
        """From now on for ``log_mentions`` (a node's log file is appended to by every fleet of its name)."""
        self._log_marks = {worker.log_path: len(worker.log()) for worker in self.workers}

    def log_mentions(self, text: str) -> int:
        """Lines of the workers' logs since the last ``mark_logs`` (the fleet's start) that contain ``text``."""
        marks = getattr(self, "_log_marks", {})
        return sum(line.count(text) > 0 for worker in self.workers
                   for line in worker.log()[marks.get(worker.log_path, 0):].splitlines())

    def pids(self) -> dict[str, list[int]]:
        return {"worker main": [w.pid for w in self.workers if w.pid],
                "worker pool process": [c for w in self.workers for c in w.children()]}

    def stop(self) -> None:
        for worker in self.workers:  # all at once: each takes a while to finish its task and exit
            if worker.alive:
                signal_group(worker.pid, signal.SIGTERM)
        for worker in self.workers:
            worker.stop(grace_s=15)


class Stack:
    """The whole stack as docs/configuration.md runs it: the receiver (``receiver_server``, 4 workers), two
    ``celery -A workers worker --concurrency 2`` (2 parents, 4 pool children) and the recovery
    sweep (``ledgerctl sweep --loop``), all of ``checkout``'s revision. ``start`` returns once
    every process is up; the workers consume from then on, which the caller's warm-up shows."""

    def __init__(self, env: Mapping[str, str], log_dir: Path, *, queue: str, label: str,
                 checkout: Checkout = Checkout(), receiver_server: str = DEFAULT_RECEIVER_SERVER,
                 receiver_workers: int = 4, receiver_threads: int | None = None,
                 workers: int = 2, concurrency: int = 2):
        self.receiver = checkout.adopt(Receiver(env, log_dir, server=receiver_server, workers=receiver_workers,
                                                threads=receiver_threads,
                                                ready_path="/readyz", extra_args=("--backlog", "2048")))
        self.fleet = WorkerFleet(env, log_dir, count=workers, queue=queue, label=label, concurrency=concurrency,
                                 readme=True, checkout=checkout)
        self.sweep = checkout.adopt(Sweep(env, log_dir, name=f"{label}-sweep"))

    def start(self, timeout_s: float = 90) -> "Stack":
        self.sweep.start()
        self.fleet.start(timeout_s)
        self.receiver.start(timeout_s)
        self.sweep.ensure_alive()
        return self

    def pids(self) -> dict[str, list[int]]:
        """The process types whose CPU ``steady`` reports."""
        workers = self.fleet.pids()
        return {"receiver": [p for pids in self.receiver.pids().values() for p in pids],
                "worker parents": workers["worker main"], "worker pool children": workers["worker pool process"],
                "sweep": [self.sweep.pid, *self.sweep.children()] if self.sweep.pid else []}

    def stop(self) -> None:
        self.receiver.stop()
        self.fleet.stop()
        self.sweep.stop()


class MachineCpu:
    """The whole machine's CPU over a window, from the first line of /proc/stat (every core together).

    ``busy`` is 1 - idle/total, a fraction of all cores (1.0: every core busy the whole window);
    time waiting on I/O with nothing to run (iowait) is not idle by this measure, and is reported
    apart (``iowait``). Everything on the machine counts: the measured processes, the benchmark's
    own, and whatever else runs on a shared machine.
    """

    @staticmethod
    def _read() -> list[int]:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()[1:]
        return [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal (guest is in user)

    def begin(self) -> "MachineCpu":
        self._t0 = self._read()
        return self

    def end(self) -> dict[str, float]:
        delta = [b - a for a, b in zip(self._t0, self._read())]
        total = sum(delta) or 1
        return {"busy": 1 - delta[3] / total, "iowait": delta[4] / total,
                "user": (delta[0] + delta[1]) / total, "system": (delta[2] + delta[5] + delta[6]) / total}


@dataclass
class ProcessWatch:
    """CPU seconds and peak RSS of named groups of processes over a phase."""
    groups: Callable[[], dict[str, list[int]]]
    _start: dict[int, float] = field(default_factory=dict)

    def begin(self) -> None:
        self._start = {pid: cpu_seconds(pid) for pids in self.groups().values() for pid in pids}

    def cpu_s(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pids in self.groups().items():
            out[name] = sum(max(0.0, cpu_seconds(pid) - self._start.get(pid, 0.0)) for pid in pids)
        return out

    def peak_rss_mb(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pids in self.groups().items():
            peaks = [memory_kb(pid).get("VmHWM", 0) for pid in pids]
            if peaks:
                out[name] = max(peaks) / 1024
        return out


def wire_segments(pids: list[int], port: int) -> dict[tuple[int, int], tuple[int, int]]:
    """Per TCP connection of these processes to ``port``: (data segments in, data segments out).

    From the kernel's own counters (``ss -ti``). Postgres sends its answers only
    when the client asks (Sync, Flush) or its buffer fills, so the data segments
    a client receives on loopback (MSS of tens of KB) count its round trips,
    pipelined or not; the segments it sends count its writes.
    """
    out = subprocess.run(["ss", "-tinpH", "dst", f"127.0.0.1:{port}"], capture_output=True, text=True).stdout
    wanted = set(pids)
    counts: dict[tuple[int, int], tuple[int, int]] = {}
    for head, info in zip(*[iter(out.splitlines())] * 2):
        pid_match = re.search(r"pid=(\d+)", head)
        local = re.search(r"127\.0\.0\.1:(\d+)\s", head)
        if not pid_match or not local or int(pid_match[1]) not in wanted:
            continue
        seg_in = re.search(r"data_segs_in:(\d+)", info)
        seg_out = re.search(r"data_segs_out:(\d+)", info)
        counts[(int(pid_match[1]), int(local[1]))] = (int(seg_in[1]) if seg_in else 0,
                                                      int(seg_out[1]) if seg_out else 0)
    return counts
