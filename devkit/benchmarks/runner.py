"""ops/bench <scenario>|all [--quick]: the runner every scenario runs on (docs/benchmarks.md).

It owns the run: the private Postgres and Redis (a RabbitMQ vhost with --broker amqp|both), the
receiver and worker fleets of each revision measured (this checkout, and --compare's), the counters
(statements, commits, round trips, broker commands, CPU per process), the report tables, results.json
and the docs' two written blocks. A scenario is a module of ``scenarios`` listed in SCENARIOS:
``run(b)`` returns its figures, ``report(result)`` its table and its SUMMARY figures. Scenarios never
import each other: one that needs another's figures (scale) asks ``scenario(name)``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psycopg

from devkit.procs import REPO, Cleanup
from devkit.servers import PrivateRedis, RabbitVhost
from devkit.sql import SQL
from devkit.stack import DEFAULT_RECEIVER_SERVER, DEFAULT_THREADS, RECEIVER_SERVERS, Receiver
from ledger.config import Settings
from ledger.migrate import migrate
from ledger.queries import load

from . import brokers, payloads, peer, revisions
from .loadgen import Wrk
from .payloads import SignedDelivery
from .pg import BenchDatabase, url_parts
from .revisions import Revision
from .stack import ProcessWatch, WorkerFleet, bench_postgres, wire_segments
from .workload import BacklogEvent, EventSource, history_sql

# The benchmark's own counters (counters.sql): deadlocks, deadlocked attempts, backends.
COUNTERS = load("devkit.benchmarks")
SECRET = "whsec_bench_0123456789abcdefghij"
THIN_SECRET = "whsec_bench_thin_0123456789abcdef"  # the event destination's (/webhooks/stripe/thin)
QUEUE = "bench-events"
# Requests are signed before the run starts: a day's tolerance keeps them valid; verifying costs the same.
SIGNATURE_TOLERANCE_S = 86400
# The documented pools (docs/configuration.md): 2 `celery -A workers worker --concurrency 2`.
README_POOLS = {"workers": 2, "concurrency": 2}
README_POOLS_LABEL = "2×2 (README)"
DOCS = REPO / "docs" / "benchmarks.md"

# name -> module of devkit.benchmarks.scenarios; ALL is what `ops/bench all` runs, in order.
SCENARIOS = {"ingest": "ingest", "drain": "drain", "burst": "burst", "replay": "replay", "scale": "scale",
             "cost": "cost", "profile": "profile", "steady": "steady", "receiver-cost": "receiver_cost",
             "rescue": "rescue", "retention": "retention", "reproject": "reproject"}
ALL = ("ingest", "drain", "burst", "replay", "scale", "cost", "receiver-cost", "steady")


def scenario(name: str):
    return importlib.import_module(f"devkit.benchmarks.scenarios.{SCENARIOS[name]}")


@dataclass
class Options:
    quick: bool = False
    levels: tuple[int, ...] = (1, 8, 32, 64)
    worker_counts: tuple[int, ...] = (1, 2, 4)
    ingest_s: float = 6.0
    drain_events: int = 20_000
    drain_s: float = 12.0
    drain_warmup_s: float = 2.0
    full_drain: bool = False
    burst_events: int = 10_000
    burst_connections: int = 32
    replay_events: int = 10_000
    history_events: int = 1_000_000
    receiver_server: str = DEFAULT_RECEIVER_SERVER
    receiver_workers: int = 2
    receiver_threads: int | None = None  # None: the server's own default (devkit.stack.DEFAULT_THREADS)
    burst_worker_nice: int = 0
    steady_levels: tuple[int, ...] = (1, 8, 32)
    steady_events: int = 6_000
    steady_payload: str = "snapshot"
    thin_snapshot_twin: bool = True
    thin_latency_ms: float = 0.0
    fetch_concurrency: int | None = None
    compare: str | None = None
    brokers: tuple[str, ...] = ("redis",)
    peer: bool | None = None  # None: when node and npm are on PATH
    receiver_cost_requests: int = 4_000
    receiver_cost_rounds: int = 2
    receiver_cost_connections: int = 8
    out_dir: Path = field(default_factory=lambda: Path("/tmp"))

    @classmethod
    def make(cls, quick: bool, out_dir: Path, **overrides) -> "Options":
        """The defaults (--quick: small sizes, every code path), then every option given."""
        sizes = dict(quick=True, ingest_s=1.5, drain_events=4_000, drain_s=4.0, drain_warmup_s=1.0, burst_events=1_000,
                     replay_events=1_000, history_events=50_000, steady_events=600, receiver_cost_requests=1_500,
                     receiver_cost_rounds=1) if quick else {}
        opts = cls(out_dir=out_dir, **{**sizes, **{k: v for k, v in overrides.items() if v is not None}})
        if overrides.get("receiver_server") is None and (opts.receiver_threads or 1) > 1:
            opts.receiver_server = "gunicorn-gthread"  # --receiver-threads alone: gunicorn's threaded workers
        return opts


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def receiver_kind(server: str, workers: int, threads: int | None = None) -> str:
    threads = threads or DEFAULT_THREADS.get(server, 1)
    return {"granian": f"granian, {workers} workers of {threads} blocking threads",
            "gunicorn-gthread": f"gunicorn, {workers} gthread workers of {threads} threads"}.get(
        server, f"gunicorn, {workers} sync workers")


@dataclass
class Side:
    """One revision's share of the run: its database (by its own migrations), environment and results."""
    revision: Revision
    db: BenchDatabase
    env: dict[str, str]
    settings: Settings
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.revision.label


class Bench:
    """The run: private servers, the receiver, worker fleets, and the results so far. ``db``, ``env``,
    ``settings``, ``checkout`` and ``results`` are the active side's (``using``)."""

    def __init__(self, opts: Options):
        self.opts, self.work, self.cleanup = opts, opts.out_dir, Cleanup("bench")
        self.peak_rss: dict[str, float] = {}
        self.label = "empty"  # the ledger's history: "empty", or history_label's
        self.sides: list[Side] = []
        self.side: Side | None = None
        self.results: dict[str, Any] = {}
        self.rabbit: RabbitVhost | None = None
        self.broker = opts.brokers[0]
        self._receiver: Receiver | None = None
        self._sources: dict[str, EventSource] = {}
        self._templates = self._peer_home = None

    def start(self) -> "Bench":
        if "amqp" in self.opts.brokers and not RabbitVhost.available():
            raise RuntimeError("--broker amqp|both: no RabbitMQ answers on 127.0.0.1:5672, or rabbitmqctl cannot "
                               "manage it (Debian: apt-get install rabbitmq-server)")
        # First: a revision that cannot be installed fails the run before anything starts.
        other = revisions.prepare(self.opts.compare, self.work, self.cleanup, log) if self.opts.compare else None
        log("starting a private PostgreSQL and Redis")
        self.pg = bench_postgres()
        self.cleanup.add("private postgres", self.pg.destroy)
        self.pg.init().start()
        self.redis = PrivateRedis(self.work / "redis.log")
        self.cleanup.add("private redis", lambda: self.redis.stop(grace_s=5))
        self.redis.start()
        if "amqp" in self.opts.brokers:
            self.rabbit = RabbitVhost(f"ledger-bench-{os.getpid()}")
            log(f"creating the RabbitMQ vhost {self.rabbit.name} (rabbitmqctl)")
            self.cleanup.add("RabbitMQ vhost", self.rabbit.drop)
            self.rabbit.create()
        if other is not None:
            log(f"migrating the database of {other.label} with its own ledgerctl migrate")
            self.sides.append(self.side_for(other, f"ledger_bench_{other.label}",
                                            lambda url: other.migrate(url, self.redis.url)))
        self.sides.append(self.side_for(revisions.current(), "ledger_bench", migrate))
        self._activate(self.sides[-1])
        self._set_broker(self.broker)
        self.wrk = Wrk(self.work)
        return self

    def side_for(self, revision: Revision, database: str, migrate_with) -> Side:
        """A database of its own for ``revision`` on the private server, migrated by ``migrate_with``."""
        db = BenchDatabase(self.pg.url_for, name=database).create(migrate_with)
        self.cleanup.add(f"monitor connection ({database})", db.close)
        env = revision.checkout.env(db.url, self.redis.url, {
            "STRIPE_WEBHOOK_SECRET": SECRET, "LEDGER_QUEUE": QUEUE,
            "STRIPE_SIGNATURE_TOLERANCE_S": str(SIGNATURE_TOLERANCE_S)})
        return Side(revision, db, env, Settings(database_url=db.url, broker_url=self.redis.url, queue_name=QUEUE,
                                                webhook_secrets=(SECRET,)))

    def _activate(self, side: Side) -> None:
        self.side, self.db, self.env, self.settings = side, side.db, side.env, side.settings
        self.checkout, self.results, self.pg_parts = side.revision.checkout, side.results, url_parts(side.db.url)

    @property
    def baseline(self) -> Side | None:
        """The older revision of ``--compare``, if any."""
        return next((s for s in self.sides if not s.revision.current), None)

    @contextlib.contextmanager
    def using(self, side: Side):
        """What follows against ``side``: its database, its revision's processes."""
        previous = self.side
        if side is not previous:
            self.stop_receiver()
            self.drop_queue()
        self._activate(side)
        try:
            yield side
        finally:
            if side is not previous:
                self.stop_receiver()
            self._activate(previous)

    # -- brokers -------------------------------------------------------------------------------
    @property
    def broker_url(self) -> str:
        if self.broker == "amqp" and self.rabbit is None:
            raise RuntimeError("no RabbitMQ vhost: run with --broker amqp or both")
        return self.redis.url if self.broker == "redis" else self.rabbit.url

    @property
    def broker_label(self) -> str:
        return brokers.LABELS[self.broker]

    def _set_broker(self, broker: str) -> None:
        self.broker = broker
        for side in self.sides:
            side.env["CELERY_BROKER_URL"] = self.broker_url
            side.settings = dataclasses.replace(side.settings, broker_url=self.broker_url)
        self._activate(self.side)

    @contextlib.contextmanager
    def using_broker(self, broker: str):
        """What follows with every process of the stack on ``broker`` (its queue emptied before and after)."""
        previous = self.broker
        if broker != previous:
            self.stop_receiver()
            self.drop_queue()
            self._set_broker(broker)
        try:
            yield broker
        finally:
            if broker != previous:
                self.stop_receiver()
                self.drop_queue()
                self._set_broker(previous)

    def drop_queue(self) -> None:
        brokers.purge(self.broker, self.broker_url, QUEUE)

    def push_wakeups(self, event_ids: list[str]) -> None:
        brokers.push_wakeups(self.broker, self.broker_url, QUEUE, event_ids)

    def broker_commands(self) -> dict[str, int]:
        return brokers.commands(self.broker, self.broker_url)

    def broker_group(self) -> dict[str, list[int]]:
        """The broker's server process, by its label, for the CPU tables."""
        if self.broker == "redis":
            return {"Redis": [self.redis.pid]}
        return {"RabbitMQ": [pid] if (pid := brokers.rabbitmq_pid()) else []}

    # -- counters ------------------------------------------------------------------------------
    def deadlocks(self, *databases: str) -> int:
        """pg_stat_database.deadlocks of these databases (default: every side's) so far."""
        return self._database_counter(COUNTERS.bench_deadlocks, databases)

    def commits(self, *databases: str) -> int:
        """pg_stat_database.xact_commit of these databases (default: every side's) so far."""
        return self._database_counter(COUNTERS.bench_commits_of, databases)

    def _database_counter(self, sql: str, databases: tuple[str, ...]) -> int:
        self.db.q(SQL.bench_stats_clear_snapshot)  # the monitor's own snapshot would repeat its last read
        return int(self.db.one(sql, {"databases": list(databases) or [s.db.name for s in self.sides]}))

    def wait_backends_gone(self, application_name: str, timeout_s: float = 10.0) -> None:
        """Until the backends of ``application_name`` have exited (and published their counters)."""
        deadline = time.monotonic() + timeout_s
        while self.db.one(COUNTERS.bench_backends_of, {"application_name": application_name}):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def attempts_deadlocked(self, ids: list[str]) -> int:
        return int(self.db.one(COUNTERS.bench_attempts_deadlocked, {"ids": ids}))

    def peer_home(self) -> Path:
        """The sync engine installed in its cache directory (at the first call)."""
        if self._peer_home is None:
            if missing := peer.available():
                raise RuntimeError(f"the peer (Stripe's sync engine) needs Node: {missing}; or run with --no-peer")
            self._peer_home = peer.install(log)
        return self._peer_home

    # -- processes -------------------------------------------------------------------------------
    def new_receiver(self, env: dict[str, str] | None = None) -> Receiver:
        """The receiver under the run's server settings (not started), of the active side's checkout."""
        o = self.opts
        return self.checkout.adopt(Receiver(env or self.env, self.work, server=o.receiver_server,
                                            workers=o.receiver_workers, threads=o.receiver_threads,
                                            ready_path="/readyz", extra_args=("--backlog", "2048")))

    def receiver(self) -> Receiver:
        """The shared receiver of the active side, started at the first call."""
        if self._receiver is None:
            o = self.opts
            log(f"starting the receiver ({receiver_kind(o.receiver_server, o.receiver_workers, o.receiver_threads)})"
                + ("" if self.side.revision.current else f" of {self.side.label}"))
            self._receiver = self.new_receiver()
            self.cleanup.add("receiver", self._receiver.stop)
            self._receiver.start()
        return self._receiver

    def stop_receiver(self) -> None:
        if self._receiver is not None:
            self.note_rss(ProcessWatch(self._receiver.pids).peak_rss_mb())
            self._receiver.stop()
            self.cleanup.remove(self._receiver.stop)
            self._receiver = None

    def readme_fleet(self):
        return self.fleet(README_POOLS["workers"], label="readme", concurrency=README_POOLS["concurrency"],
                          readme=True)

    @contextlib.contextmanager
    def fleet(self, count: int, label: str = "w", nice: int = 0, *, concurrency: int = 1, readme: bool = False):
        fleet = WorkerFleet(self.env, self.work, count=count, queue=QUEUE, label=label, nice=nice,
                            concurrency=concurrency, readme=readme, checkout=self.checkout)
        with self.started(f"{count} workers", fleet):
            try:
                yield fleet
            finally:
                self.note_rss(ProcessWatch(fleet.pids).peak_rss_mb())

    @contextlib.contextmanager
    def started(self, what: str, process):
        """``process`` started for what follows, stopped after (and by the cleanup on Ctrl-C)."""
        stop = process.stop
        self.cleanup.add(what, stop)
        try:
            process.start()
            yield process
        finally:
            stop()
            self.cleanup.remove(stop)

    def note_rss(self, peaks: dict[str, float]) -> None:
        for name, mb in peaks.items():
            self.peak_rss[name] = max(self.peak_rss.get(name, 0.0), mb)

    def finish(self) -> None:
        if self._receiver is not None:
            self.note_rss(ProcessWatch(self._receiver.pids).peak_rss_mb())

    # -- state and payloads ----------------------------------------------------------------------
    def clear(self) -> None:
        """Empty ledger: truncate everything. With history: delete what is not history (unfinished rows)."""
        self.drop_queue()
        if self.label == "empty":
            self.db.reset()
        else:
            self.db.q_past_deadlocks(SQL.bench_delete_unfinished)
            # Back to what TRUNCATE gives the empty ledger: partial indexes holding only live rows.
            self.db.vacuum("ledger.events", "ledger.deliveries", index_cleanup=True)

    def _source(self, name: str, count: int, **kwargs) -> EventSource:
        # Generated once, re-issued under fresh ids as often as a backlog needs (EventSource.backlog).
        if name not in self._sources:
            log(f"generating {count // 10} subscription lifecycles ({count} events)")
            self._sources[name] = EventSource(payloads.lifecycles(count // 10, **kwargs))
        return self._sources[name]

    @property
    def source(self) -> EventSource:
        o = self.opts
        return self._source("default", min(4000, max(o.drain_events, o.burst_events, o.replay_events)))

    @property
    def steady_source(self) -> EventSource:
        """Basil-era (2025-03-31) lifecycles."""
        return self._source("steady", min(4000, self.opts.steady_events), seed=13, api_version=payloads.BASIL_API)

    @property
    def templates(self):
        if self._templates is None:
            self._templates = payloads.ingest_templates(lifecycle_count=4)
        return self._templates

    def fresh_backlog(self, count: int) -> list[BacklogEvent]:
        """``count`` events under fresh ids (not loaded yet), on a cleared ledger."""
        self.clear()
        return self.source.backlog(count)

    def deliveries(self, templates, count: int, seed: int) -> list[SignedDelivery]:
        return payloads.signed_deliveries(templates, count, SECRET, seed=seed)

    def signed(self, events: list[BacklogEvent]) -> list[SignedDelivery]:
        """A delivery of each of ``events`` as they are (ids and bodies kept), signed now."""
        now = int(time.time())
        return [SignedDelivery(e.id, e.body, payloads.sign(e.body, SECRET, timestamp=now)) for e in events]

    def signed_thin(self, notifications: list[dict[str, Any]]) -> list[SignedDelivery]:
        """Each thin notification to /webhooks/stripe/thin, signed now with the destination's secret."""
        now, texts = int(time.time()), [(n["id"], payloads.body(n)) for n in notifications]
        return [SignedDelivery(i, t, payloads.sign(t, THIN_SECRET, timestamp=now), path=payloads.THIN_PATH)
                for i, t in texts]


class Meter:
    """Per-event cost over a phase: statements, transactions, broker commands, round trips, CPU. Postgres 15
    publishes a backend's transactions only as it exits: the caller makes the measured backends exit before
    ``begin_sql`` and ``finish``. SQL figures are per call of ``anchor`` (the receiver's statement) or, with
    none, per event counted by ``progress``, as CPU is."""

    def __init__(self, bench: Bench, groups: Callable[[], dict[str, list[int]]]):
        self.b, self.watch = bench, ProcessWatch(groups)

    def begin_sql(self) -> None:
        db = self.b.db
        db.reset_statements()
        self.x0, self.m0, self.r0 = db.xact_commits(), db.monitor_statements, self.b.broker_commands()

    def _wire(self) -> dict[tuple[int, int], tuple[int, int]]:
        return wire_segments([pid for pids in self.watch.groups().values() for pid in pids], self.b.pg.port)

    def begin_cpu(self, progress: Callable[[], int]) -> None:
        self.pg0 = self.b.pg.cpu_s()
        self.watch.begin()
        self.w0, self.t0, self.p0 = self._wire(), time.monotonic(), progress()

    def end_cpu(self, progress: Callable[[], int]) -> None:
        self.cpu = self.watch.cpu_s()
        self.pg_cpu = self.b.pg.cpu_s() - self.pg0
        w1 = self._wire()  # connections opened in the window count from zero
        self.wire_in = sum(i - self.w0.get(k, (0, 0))[0] for k, (i, _) in w1.items())
        self.wire_out = sum(o - self.w0.get(k, (0, 0))[1] for k, (_, o) in w1.items())
        self.elapsed = time.monotonic() - self.t0
        self.cpu_events = progress() - self.p0

    def finish(self, anchor: str | None) -> dict[str, Any]:
        db = self.b.db
        statements = db.statements()
        r1 = self.b.broker_commands()
        xacts = db.xact_commits() - self.x0 - (db.monitor_statements - self.m0) - 1  # minus the bench's reads
        redis = {k: v - self.r0.get(k, 0) for k, v in r1.items() if k != "info" and v - self.r0.get(k, 0)}
        calls = sum(s["calls"] for s in statements)
        # No anchor: per processed event (a set-based finish covers a whole batch in one call).
        anchored = sum(s["calls"] for s in statements if s["name"] == anchor) if anchor else 0
        events = anchored or max(self.cpu_events, 1)
        by_name: dict[str, float] = {}
        exec_ms: dict[str, float] = {}
        for s in statements:
            by_name[s["name"]] = by_name.get(s["name"], 0) + s["calls"] / events
            exec_ms[s["name"]] = exec_ms.get(s["name"], 0) + s["exec_ms"] / events
        n = max(self.cpu_events, 1)
        descending = lambda d: dict(sorted(d.items(), key=lambda kv: -kv[1]))  # noqa: E731
        return {"events": events, "cpu_events": self.cpu_events, "elapsed_s": self.elapsed,
                "statements_per_event": calls / events, "round_trips_per_event": self.wire_in / n,
                "client_writes_per_event": self.wire_out / n, "transactions_per_event": xacts / events,
                "statements_by_name": descending(by_name), "exec_ms_by_name": descending(exec_ms),
                "redis_commands_per_event": sum(redis.values()) / events,
                "redis_by_command": {k: v / events for k, v in descending(redis).items()},
                "cpu_ms_per_event": {k: 1000 * v / n for k, v in self.cpu.items()},
                "postgres_cpu_ms_per_event": 1000 * self.pg_cpu / n, "cpu_s": self.cpu, "postgres_cpu_s": self.pg_cpu}


def end_backends(b: Bench, application_name: str) -> None:
    """Make a process's Postgres backends exit (they publish their counters as they do)."""
    b.db.q(SQL.bench_backends_terminate, {"application_name": application_name})
    b.wait_backends_gone(application_name)


def wait_drained(b: Bench, timeout_s: float, remaining: int = 0, *, fail: bool = True, poll_s: float = 0.25) -> None:
    """Until at most ``remaining`` events are unfinished (``fail``: else an error after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while b.db.unfinished() > remaining:
        if time.monotonic() > deadline:
            if not fail:
                return
            raise RuntimeError(f"backlog not drained within {timeout_s:.0f}s ({b.db.unfinished()} left)")
        time.sleep(poll_s)


def run_stats(b: Bench, ids: list[str]) -> dict[str, Any]:
    processed, other, *times = b.db.q(SQL.bench_run_stats, {"ids": ids})[0]
    return {"processed": processed, "not_processed": other, **{k: float(t or 0) for k, t in zip(
        ("first_claim", "last_processed", "max_wait_s", "first_received"), times)}}


def ensure_recorded(b: Bench, rc: Receiver, deliveries: list[SignedDelivery], *, settle_s: float = 1.5) -> int:
    """Until every delivery has its ledger row, sending again those that never arrived (wrk
    occasionally drops a request its Lua script handed it); returns how many were sent again."""
    ids = [d.event_id for d in deliveries]
    resent = 0
    for _ in range(5):
        deadline = time.monotonic() + settle_s
        while True:
            present = {r[0] for r in b.db.q(SQL.bench_events_present, {"ids": ids})}
            missing = [d for d in deliveries if d.event_id not in present]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not missing:
            return resent
        resent += len(missing)
        b.wrk.run(rc.port, missing, min(8, len(missing)), max_duration_s=60)
    raise RuntimeError(f"{len(missing)} deliveries never recorded")


def wait_processed(b: Bench, rc: Receiver, unique: list[SignedDelivery], timeout_s: float) -> int:
    """Every delivery has its row (those sent again returned) and none is unfinished."""
    resent = ensure_recorded(b, rc, unique) if b.db.one(SQL.bench_events_count) < len(unique) else 0
    wait_drained(b, timeout_s, poll_s=0.05)
    return resent


def with_redeliveries(deliveries: list[SignedDelivery], share: float, *, seed: int) -> list[SignedDelivery]:
    """``deliveries`` with ``share`` of redeliveries mixed in, each repeating an earlier delivery at a
    random later place: some find their event waiting or in progress, most find it processed."""
    import random

    rng = random.Random(seed)
    keyed = [(float(i), d) for i, d in enumerate(deliveries)]
    for _ in range(round(len(deliveries) * share / (1 - share))):
        i = rng.randrange(len(deliveries) - 1)
        keyed.append((rng.uniform(i + 0.5, len(deliveries)), deliveries[i]))
    keyed.sort(key=lambda kv: kv[0])
    return [d for _, d in keyed]


def history_label(events: int) -> str:
    """How results name a ledger with a history of ``events``: 1M, 3M, 50k."""
    return f"{events // 1_000_000}M" if events % 1_000_000 == 0 else f"{events // 1000}k"


def prefill_history(b: Bench, total: int | None = None, *, days: float = 400.0, step_s: float = 30.0) -> dict:
    """A history of ``total`` processed events (default --history-events) and their business rows,
    written set-based on two connections at once; the events' non-partial secondary indexes are
    dropped for the load and rebuilt from their own definitions, then everything is vacuumed."""
    from devkit.sql import compose

    total = total or b.opts.history_events
    log(f"writing a history of {total:,} processed events and their business rows (set-based SQL)")
    b.clear()
    sample = b.source.events[0]
    template = payloads.body(sample).replace(sample["id"], "__EVT__").replace(sample["data"]["object"]["id"], "__CUS__")
    compact = json.dumps(json.loads(template), separators=(",", ":"))
    events_sql, other_sql, params = history_sql(total, compact, days=days, step_s=step_s)
    rebuilt = b.db.q(SQL.bench_history_secondary_indexes)
    started = time.monotonic()

    def run(statements: list[str], params: dict[str, Any] | None = None) -> None:
        with psycopg.connect(b.db.url, autocommit=True) as conn:
            conn.execute(SQL.bench_bulk_load_replica)
            conn.execute(SQL.bench_bulk_load_memory)
            for statement in statements:
                conn.execute(statement, params)

    for name, _ in rebuilt:
        b.db.q(compose(SQL.bench_index_drop, index=f"ledger.{name}"))
    with ThreadPoolExecutor(max(2, len(rebuilt))) as pool:  # the two halves at once, then every index at once
        list(pool.map(run, (events_sql, other_sql), (params, params)))
        list(pool.map(run, ([definition] for _, definition in rebuilt)))
    load_s = time.monotonic() - started
    b.db.vacuum()
    b.db.q(SQL.bench_checkpoint)
    sizes = dict(b.db.q(SQL.bench_relation_sizes))
    tables = ("ledger.events", "ledger.attempts", "ledger.deliveries", "billing.customers", "billing.subscriptions",
              "billing.invoices", "billing.subscription_transitions", "billing.entitlements")
    result = {"events": total, "load_s": load_s, "total_s": time.monotonic() - started,
              "payload_bytes": len(compact), "rows": {t: b.db.one(compose(SQL.bench_rows, table=t)) for t in tables},
              "rebuilt_indexes": [n for n, _ in rebuilt], "database_mb": b.db.one(SQL.bench_database_size) / 2**20,
              "relation_mb": {k: v / 2**20 for k, v in sizes.items()}}
    log(f"  history written in {result['load_s']:.0f}s, vacuumed in {result['total_s'] - result['load_s']:.0f}s "
        f"(database {result['database_mb']:.0f} MB)")
    return result


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec and isinstance(value, (int, float)) else figure(value)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]] | None = None, *,
          markdown: bool = False) -> str:
    """A terminal (or markdown) table; columns: (key, header, format spec), by default the first row's keys."""
    columns = columns or [(k, k, "") for k in (rows[0] if rows else {})]
    cells = [[h for _, h, _ in columns]] + [[_fmt(r.get(k), s) for k, _, s in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(lines[:1] + ["|" + "|".join("---:" for _ in columns) + "|"] + lines[1:])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def figure(v: Any) -> str:
    return (f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}") if isinstance(v, float) else str(v)


def kv(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={figure(v)}" for k, v in values.items())


SIDE_BEGIN, SIDE_END = "<!-- bench:side-by-side (written by ops/bench steady) -->", "<!-- /bench:side-by-side -->"
FIGURES_BEGIN, FIGURES_END = "<!-- bench:figures (written by ops/bench) -->", "<!-- /bench:figures -->"


def _block(text: str, begin: str, end: str) -> tuple[str, str, str]:
    if begin not in text or end not in text:
        raise RuntimeError(f"{DOCS} has lost its markers {begin} ... {end}")
    head, rest = text.split(begin, 1)
    inner, tail = rest.split(end, 1)
    return head, inner, tail


def write_docs(results: dict[str, Any], values: dict[str, dict[str, Any]]) -> None:
    """The side-by-side table (a steady run's), and each scenario's row of the current figures, with
    the run's date, commit and load; rows of scenarios this run did not measure are kept."""
    meta = results["meta"]
    when = f"{meta['started'][:10]}, {meta['machine'].get('git', '?')}{'+' if meta['machine'].get('git_dirty') else ''}"
    load = meta["load_during"]["mean"]
    text = DOCS.read_text()
    if results.get("steady"):
        head, _, tail = _block(text, SIDE_BEGIN, SIDE_END)
        text = (f"{head}{SIDE_BEGIN}\n{scenario('steady').docs_table(results['steady'])}\n\n"
                f"Measured {when}, load mean {load:.1f} on {meta['machine'].get('cpus')} cores: "
                f"`{meta['command']}`.\n{SIDE_END}{tail}")
    head, inner, tail = _block(text, FIGURES_BEGIN, FIGURES_END)
    rows = {line.split("|")[1].strip(): line for line in inner.splitlines() if line.startswith("| `")}
    for name, figures in values.items():
        shown = getattr(scenario(name), "HEADLINE", tuple(figures)[:6])
        cells = ", ".join(f"{k}={figure(figures[k])}" for k in shown if k in figures)
        rows[f"`{name}`"] = f"| `{name}` | {when} | {load:.1f} | {cells} |"
    order = [f"`{n}`" for n in SCENARIOS]
    body = "\n".join(rows[k] for k in sorted(rows, key=lambda k: order.index(k) if k in order else 99))
    DOCS.write_text(f"{head}{FIGURES_BEGIN}\n| scenario | date, commit | load | figures |\n|---|---|---:|---|\n"
                    f"{body}\n{FIGURES_END}{tail}")


def _loadavg() -> float:
    with open("/proc/loadavg") as fh:
        return float(fh.read().split()[0])


class LoadSampler(threading.Thread):
    """The machine's 1-minute load average every 5 s while the run lasts (its own load included)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples, self._halt = [_loadavg()], threading.Event()

    def run(self) -> None:
        while not self._halt.wait(5):
            self.samples.append(_loadavg())

    def stop(self) -> dict:
        self._halt.set()
        s = self.samples
        return {"min": min(s), "mean": sum(s) / len(s), "max": max(s), "samples": len(s)}


def machine() -> dict:
    def out(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO).stdout.rstrip()
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
            "postgres": out("pgbench", "--version"), "wrk": out("wrk", "--version").partition("\n")[0],
            "redis": out("redis-server", "--version"), "git": out("git", "rev-parse", "--short", "HEAD"),
            "git_dirty": [line[3:] for line in out("git", "status", "--porcelain", "-uno").splitlines()]}


def _parser() -> argparse.ArgumentParser:
    levels = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    p = argparse.ArgumentParser(prog="ops/bench", description="ops/bench <scenario>|all [--quick]: docs/benchmarks.md",
                                epilog="scenarios: " + ", ".join(SCENARIOS) + "; 'all' runs " + ", ".join(ALL))
    add = p.add_argument
    add("scenario", nargs="?", help="all, or one or more of " + ", ".join(SCENARIOS) + " (comma-separated)")
    add("--quick", action="store_true", help="small sizes, every code path: a smoke run, not a measurement")
    add("--out", type=Path, help="directory for results.json, logs and profiles (default: a new /tmp/ledger-bench-*)")
    add("--docs", action=argparse.BooleanOptionalAction, default=None,
        help="write docs/benchmarks.md's side-by-side table and figures (default: on for a full 'all' run, "
             "or a full steady run beside the peer or --compare)")
    add("--levels", type=levels, help="ingest concurrency levels (default 1,8,32,64)")
    add("--workers", dest="worker_counts", type=levels, help="drain worker counts (default 1,2,4)")
    add("--drain-events", type=int)
    add("--drain-seconds", dest="drain_s", type=float, help="measuring window of each drain run (default 12)")
    add("--full-drain", action="store_true", default=None, help="drain each backlog to the end instead (slow)")
    add("--history-events", type=int)
    add("--ingest-seconds", dest="ingest_s", type=float)
    add("--receiver", dest="receiver_server", choices=RECEIVER_SERVERS,
        help=f"the receiver's WSGI server (default {DEFAULT_RECEIVER_SERVER}, as documented)")
    add("--receiver-workers", type=int, help="receiver worker processes (default 2, as documented)")
    add("--receiver-threads", type=int, help="threads per receiver worker (default: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_THREADS.items()) + ")")
    add("--burst-worker-nice", type=int, help="nice level of the burst's workers (default 0)")
    add("--steady-levels", type=levels, help="steady concurrency levels (default 1,8,32)")
    add("--steady-events", type=int, help="steady: events per level, plus 5%% redeliveries (default 6000; --quick 600)")
    add("--payload", dest="steady_payload", choices=("snapshot", "thin", "both"), default="snapshot",
        help="steady: snapshot events, their thin twins (the workers fetch each from a fake Stripe API), or both")
    add("--thin-snapshot-twin", action=argparse.BooleanOptionalAction, default=None,
        help="thin levels: the v2 events name their snapshot twin, as Stripe's do (default: on)")
    add("--fake-latency-ms", dest="thin_latency_ms", type=float, default=0.0,
        help="thin levels: the fake Stripe API answers after this long (Stripe: 100-400 ms; default 0)")
    add("--fetch-concurrency", type=int, help="thin levels: the workers' STRIPE_FETCH_CONCURRENCY")
    add("--broker", choices=(*brokers.BROKERS, "both"), default="redis",
        help="the private Redis (default), the machine's RabbitMQ on a vhost of the run's own, or both: steady "
             "and drain then run on each, taking turns")
    add("--peer", action=argparse.BooleanOptionalAction, default=None,
        help="steady: Stripe's sync engine on the same stream at each level (default: on when node and npm are there)")
    add("--receiver-cost-requests", type=int, help="receiver-cost: deliveries per run (default 4000; --quick 1500)")
    add("--compare", metavar="REV", help="also run revision REV's product in the same run: steady takes turns per "
        "level, any other scenario runs once per revision")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.scenario:
        parser.error("name a scenario, or all")
    if args.steady_payload != "snapshot" and args.compare:
        parser.error("--payload thin|both measures this checkout only: not with --compare")
    names = list(ALL) if args.scenario == "all" else [n.strip() for n in args.scenario.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        parser.error(f"unknown scenario(s) {', '.join(unknown) or '(none)'}: choose all or " + ", ".join(SCENARIOS))
    out = args.out or Path(tempfile.mkdtemp(prefix="ledger-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    opts = Options.make(args.quick, out, **{k: getattr(args, k) for k in (
        "levels", "worker_counts", "drain_events", "history_events", "ingest_s", "drain_s", "full_drain",
        "receiver_server", "receiver_workers", "receiver_threads", "burst_worker_nice", "steady_levels",
        "steady_events", "steady_payload", "thin_snapshot_twin", "thin_latency_ms", "fetch_concurrency",
        "compare", "peer", "receiver_cost_requests")}, brokers=brokers.choices(args.broker))
    write = args.docs if args.docs is not None else not args.quick and (
        args.scenario == "all" or ("steady" in names and (args.peer is not False or bool(args.compare))))
    meta = {"command": "ops/bench " + " ".join(argv if argv is not None else sys.argv[1:]), "scenarios": names,
            "all": args.scenario == "all", "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()}}
    log(f"results and logs in {out}; load average before: {_loadavg():.2f}")
    bench = Bench(opts)
    bench.cleanup.install_signal_handlers()
    sampler = LoadSampler()
    sampler.start()
    started = time.monotonic()
    values: dict[str, dict[str, Any]] = {}
    status = 0
    try:
        bench.start()
        for name in names:
            t0 = time.monotonic()
            module, baseline, compared = scenario(name), bench.baseline, None
            if baseline is not None and not getattr(module, "INTERLEAVED", False):
                with bench.using(baseline):
                    compared = bench.results[name] = module.run(bench)
            result = bench.results[name] = module.run(bench)
            result["wall_s"] = time.monotonic() - t0
            text, values[name] = module.report(result)
            if compared is not None:  # every figure of both, and current / compared
                old = module.report(compared)[1]
                text += f"\n\nbeside {baseline.label}:\n" + table([
                    {"figure": k, baseline.label: old[k], "current": v, "ratio": v / old[k] if old[k] else None}
                    for k, v in values[name].items() if all(isinstance(x, (int, float)) for x in (v, old.get(k)))])
            print(f"\n== {name} ({result['wall_s']:.0f}s) ==\n{text}\nSUMMARY {name} {kv(values[name])}\n", flush=True)
    except KeyboardInterrupt:
        log("interrupted: stopping everything this run started")
        status = 130
    finally:
        bench.finish()
        bench.cleanup.run()
        meta.update(wall_s=time.monotonic() - started, load_during=sampler.stop())
        if bench.baseline is not None:
            meta["compared"] = {"label": bench.baseline.label, "commit": bench.baseline.revision.commit}
            bench.results["compared"] = {k: v for k, v in bench.baseline.results.items() if not k.startswith("_")}
        bench.results.update(meta=meta, summaries={n: kv(v) for n, v in values.items()}, peak_rss_mb=bench.peak_rss)
        path = out / "results.json"
        path.write_text(json.dumps(bench.results, indent=2, default=str))
    if status == 0:
        for name, figures in values.items():
            print(f"SUMMARY {name} {kv(figures)}")
        ld = meta["load_during"]
        print(f"SUMMARY run wall_s={meta['wall_s']:.0f} load_min={ld['min']:.2f} load_mean={ld['mean']:.2f} "
              f"load_max={ld['max']:.2f} results={path}")
        if write:
            write_docs(bench.results, values)
            log(f"wrote {DOCS}")
    return status
