"""The benchmark's own stack on the toolkit (``devkit.servers``, ``devkit.stack``): a private Postgres, the real
receiver, workers and sweep, and the per-process accounting (``ProcessWatch``, ``MachineCpu``, ``wire_segments``).
Nothing here touches the machine's shared Postgres or Redis."""
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

# Durability as shipped (fsync, synchronous_commit on), as in production; sized for the 1M-event history.
POSTGRES_OPTIONS = {"max_connections": "300", "shared_buffers": "1GB",
                    "shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "top",
                    "pg_stat_statements.max": "5000", "track_io_timing": "on", "max_wal_size": "8GB",
                    "checkpoint_timeout": "15min", "maintenance_work_mem": "512MB"}


def bench_postgres() -> PrivatePostgres:
    """The benchmark's server (not started), in a temporary directory that ``destroy()`` removes."""
    return PrivatePostgres(dir=Path(tempfile.mkdtemp(prefix="ledger-bench-pg-")), options=POSTGRES_OPTIONS)


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
    """On a partitioned ledger, a partition for every month of the last ``days``, made before the rows are written
    (a migrated ledger has them for its history; a new one starts at the month 31 days back)."""
    conn.execute("SELECT ledger.partition_create(m::date) FROM generate_series(date_trunc('month', now() - "
                 "make_interval(days => %(days)s + 1)), date_trunc('month', now()), interval '1 month') m "
                 "WHERE ledger.is_partitioned()", {"days": int(days)})


class WorkerFleet:
    """``count`` ``celery -A workers worker`` of ``checkout``'s revision, one per "machine" the user adds; with
    ``readme``, each as docs/configuration.md runs it (``ReadmeWorker``: every queue, Celery's log level)."""

    def __init__(self, env: Mapping[str, str], log_dir: Path, *, count: int, queue: str, label: str = "w",
                 nice: int = 0, concurrency: int = 1, readme: bool = False, checkout: Checkout = Checkout()):
        self.concurrency, self._log_marks = concurrency, {}
        self.workers = [checkout.adopt(
            ReadmeWorker(env, log_dir, concurrency=concurrency, node=node) if readme
            else Worker(env, log_dir, queues=(queue,), concurrency=concurrency, node=node, nice=nice))
            for node in (f"{label}{index}-{os.getpid()}" for index in range(count))]

    def start(self, timeout_s: float = 90) -> "WorkerFleet":
        self.mark_logs()
        for worker in self.workers:
            worker.start()

        def pools_up() -> bool:
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
        return sum(text in line for worker in self.workers
                   for line in worker.log()[self._log_marks.get(worker.log_path, 0):].splitlines())

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
    """The whole stack of ``checkout``'s revision as docs/configuration.md runs it: receiver, README workers and
    recovery sweep. ``start`` returns once every process is up; the caller's warm-up shows them consuming."""

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
    """The whole machine's CPU over a window (first line of /proc/stat): ``busy`` = 1 - idle/total, a fraction of
    all cores, so iowait counts as busy and is reported apart too. Whatever else runs on a shared machine counts."""

    @staticmethod
    def _read() -> list[int]:
        with open("/proc/stat") as fh:
            return [int(v) for v in fh.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal

    def begin(self) -> "MachineCpu":
        self._t0 = self._read()
        return self

    def end(self) -> dict[str, float]:
        delta = [b - a for a, b in zip(self._t0, self._read())]
        total = sum(delta) or 1
        return {"busy": 1 - delta[3] / total, "iowait": delta[4] / total}


@dataclass
class ProcessWatch:
    """CPU seconds and peak RSS of named groups of processes over a phase."""
    groups: Callable[[], dict[str, list[int]]]
    _start: dict[int, float] = field(default_factory=dict)

    def begin(self) -> None:
        self._start = {pid: cpu_seconds(pid) for pids in self.groups().values() for pid in pids}

    def cpu_s(self) -> dict[str, float]:
        return {name: sum(max(0.0, cpu_seconds(pid) - self._start.get(pid, 0.0)) for pid in pids)
                for name, pids in self.groups().items()}

    def peak_rss_mb(self) -> dict[str, float]:
        return {name: max(memory_kb(pid).get("VmHWM", 0) for pid in pids) / 1024
                for name, pids in self.groups().items() if pids}


def wire_segments(pids: list[int], port: int) -> dict[tuple[int, int], tuple[int, int]]:
    """Per TCP connection of these processes to ``port``: (data segments in, data segments out), from ``ss -ti``.
    Postgres answers only when asked (Sync, Flush) or its buffer fills, so on loopback (MSS of tens of KB) the
    segments a client receives count its round trips, pipelined or not; those it sends count its writes."""
    out = subprocess.run(["ss", "-tinpH", "dst", f"127.0.0.1:{port}"], capture_output=True, text=True).stdout
    counts: dict[tuple[int, int], tuple[int, int]] = {}
    for head, info in zip(*[iter(out.splitlines())] * 2):
        pid, local = re.search(r"pid=(\d+)", head), re.search(r"127\.0\.0\.1:(\d+)\s", head)
        if pid and local and int(pid[1]) in pids:
            segs = [re.search(rf"data_segs_{way}:(\d+)", info) for way in ("in", "out")]
            counts[(int(pid[1]), int(local[1]))] = tuple(int(s[1]) if s else 0 for s in segs)
    return counts
