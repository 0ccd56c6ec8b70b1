"""The scenarios: ingest, drain, burst, replay, scale, cost, receiver-cost, steady (and profile).

Each scenario returns a JSON-able dict; ``report`` turns those into tables and
one-line summaries. Every throughput is measured next to pgbench running the
same statements against the same database, in the same run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import resource
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psycopg
from psycopg import sql as pg_sql

from devkit.procs import Cleanup, cpu_seconds, venv_tool
from devkit.servers import PrivateRedis, RabbitVhost
from devkit.sql import SQL, compose
from devkit.stack import DEFAULT_RECEIVER_SERVER, Checkout, Receiver
from devkit.stripe_api import DEFAULT_API_KEY, FakeStripe, FakeStripeProcess
from ledger.migrate import migrate
from ledger.config import Settings
from ledger.queries import SQL as LEDGER_SQL
from ledger.queries import load

from . import brokers, payloads, peer, report, revisions
from .loadgen import Wrk
from .payloads import SignedDelivery
from .pg import BenchDatabase, run_pgbench, url_parts
from .rescue import rescue
from .reproject import scenario as reproject_scenario
from .retention import scenario as retention_scenario
from .revisions import Revision
from .stack import MachineCpu, ProcessWatch, Stack, WorkerFleet, bench_postgres, wire_segments
from .workload import (BacklogEvent, DrainScript, EventSource, history_sql, ingest_scripts, load_received,
                       wakeup_template)

# The benchmark's own counters (counters.sql): deadlocks, deadlocked attempts, backends.
COUNTERS = load("devkit.benchmarks")
SECRET = "whsec_bench_0123456789abcdefghij"
# The event destination's secret (thin notifications, /webhooks/stripe/thin): a list of its own.
THIN_SECRET = "whsec_bench_thin_0123456789abcdef"
QUEUE = "bench-events"
# Replayed requests are signed before the run starts: a tolerance of a day keeps them valid.
# Verification costs the same whatever the timestamp's age (one HMAC-SHA256 either way).
SIGNATURE_TOLERANCE_S = 86400


@dataclass
class Options:
    quick: bool = False
    levels: tuple[int, ...] = (1, 8, 32, 64)
    worker_counts: tuple[int, ...] = (1, 2, 4)
    ingest_s: float = 6.0
    drain_events: int = 20_000
    drain_s: float = 12.0
    drain_warmup_s: float = 2.0
    drain_pgbench_s: float = 6.0
    full_drain: bool = False
    burst_events: int = 10_000
    burst_connections: int = 32
    replay_events: int = 10_000
    history_events: int = 1_000_000
    # The receiver's WSGI server (devkit.stack.RECEIVER_SERVERS; --receiver), its worker processes
    # and threads per worker (None: the server's own default, devkit.stack.DEFAULT_THREADS).
    receiver_server: str = DEFAULT_RECEIVER_SERVER
    receiver_workers: int = 2
    receiver_threads: int | None = None
    # Nice level of the burst's workers (--burst-worker-nice): a way to let acknowledgements
    # win the CPU on a host shared with the receiver; 0, as deployed by default.
    burst_worker_nice: int = 0
    # steady: the whole stack at each concurrency, a fixed number of events per level
    # (plus STEADY_REDELIVERY_SHARE of redeliveries), the ledger emptied between levels.
    steady_levels: tuple[int, ...] = (1, 8, 32)
    steady_events: int = 6_000
    # What steady sends (--payload): snapshot events, their thin twins (the workers fetch each
    # from a fake Stripe API), or both, taking turns per level.
    steady_payload: str = "snapshot"
    # Thin levels: the v2 events the workers fetch name their snapshot twin (--no-thin-snapshot-twin: not).
    thin_snapshot_twin: bool = True
    # Thin levels: how long the fake takes to answer each request (--fake-latency-ms; Stripe takes
    # 100-400 ms), and the workers' STRIPE_FETCH_CONCURRENCY (--fetch-concurrency; None: the default).
    thin_latency_ms: float = 0.0
    fetch_concurrency: int | None = None
    # --compare REV: that revision's product measured beside this checkout's (revisions.py).
    compare: str | None = None
    # --floor [REV]: that commit's product with handlers that write nothing, beside this checkout's in
    # steady (revisions.py); None: not measured.
    floor: str | None = None
    # --broker: the brokers the stack runs on (brokers.py), the first one for every scenario; steady
    # and drain run once per broker.
    brokers: tuple[str, ...] = ("redis",)
    # steady: Stripe's sync engine (peer/) fed the same stream at each level (--no-peer: not; None:
    # when node and npm are on PATH).
    peer: bool | None = None
    # receiver-cost: deliveries per measured run, runs per server (taking turns), connections.
    receiver_cost_requests: int = 4_000
    receiver_cost_rounds: int = 2
    receiver_cost_connections: int = 8
    out_dir: Path = field(default_factory=lambda: Path("/tmp"))

    @classmethod
    def make(cls, quick: bool, out_dir: Path, **overrides) -> "Options":
        if quick:
            base = cls(quick=True, levels=(1, 8, 32, 64), worker_counts=(1, 2, 4), ingest_s=1.5,
                       drain_events=4_000, drain_s=4.0, drain_warmup_s=1.0, drain_pgbench_s=2.0,
                       burst_events=1_000, replay_events=1_000, history_events=50_000, steady_events=600,
                       receiver_cost_requests=1_500, receiver_cost_rounds=1, out_dir=out_dir)
        else:
            base = cls(out_dir=out_dir)
        for key, value in overrides.items():
            if value is not None:
                setattr(base, key, value)
        if overrides.get("receiver_server") is None and (base.receiver_threads or 1) > 1:
            base.receiver_server = "gunicorn-gthread"  # --receiver-threads alone: gunicorn's threaded workers
        return base


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Side:
    """One revision's share of the run: its database (migrated by that revision's own
    migrations), its processes' environment, and its results so far."""
    revision: Revision
    db: BenchDatabase
    env: dict[str, str]
    settings: Settings
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.revision.label


class Bench:
    """The run: private servers, the receiver, worker fleets, and the results so far.

    Each revision measured (this checkout; with ``--compare``, an older one as well; with
    ``--floor``, the floor, which steady alone runs) is a ``Side`` with a database of its own on
    the same private server; ``db``, ``env``, ``settings`` and ``results`` are the active side's
    (``using``).
    """

    def __init__(self, opts: Options):
        self.opts = opts
        self.work = opts.out_dir
        self.cleanup = Cleanup("bench")
        self.peak_rss: dict[str, float] = {}
        self._receiver: Receiver | None = None
        self._source: EventSource | None = None
        self._steady_source: EventSource | None = None
        self._templates = None
        self.label = "empty"
        self.sides: list[Side] = []
        self.side: Side | None = None
        self._unstarted: dict[str, Any] = {}  # the results of a run stopped before its database existed
        self.rabbit: RabbitVhost | None = None
        self.broker = opts.brokers[0]  # the broker every process of the stack is started on now
        self._peer_home: Path | None = None

    # -- set-up ----------------------------------------------------------------------------
    def start(self) -> "Bench":
        baseline = None
        if "amqp" in self.opts.brokers and not RabbitVhost.available():
            raise RuntimeError("--broker amqp|both: no RabbitMQ answers on 127.0.0.1:5672, or rabbitmqctl cannot "
                               "manage it (Debian: apt-get install rabbitmq-server)")
        if self.opts.compare:  # first: a revision that cannot be installed fails the run before anything starts
            baseline = revisions.prepare(self.opts.compare, self.work, self.cleanup, log)
        floor = revisions.prepare(self.opts.floor, self.work, self.cleanup, log, floor=True) if self.opts.floor else None
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
        if baseline is not None:
            log(f"migrating the database of {baseline.label} with its own ledgerctl migrate")
            self.sides.append(self._side(baseline, f"ledger_bench_{baseline.label}",
                                         lambda url: baseline.migrate(url, self.redis.url)))
        if floor is not None:
            log(f"migrating the database of {floor.label} with its own ledgerctl migrate")
            self.sides.append(self._side(floor, f"ledger_bench_floor_{floor.commit[:7]}",
                                         lambda url: floor.migrate(url, self.redis.url)))
        self.side = self._side(revisions.current(), "ledger_bench", migrate)
        self.sides.append(self.side)
        self._set_broker(self.broker)
        self.wrk = Wrk(self.work)
        return self

    # -- brokers ---------------------------------------------------------------------------
    def broker_url_of(self, broker: str) -> str:
        if broker == "redis":
            return self.redis.url
        if self.rabbit is None:
            raise RuntimeError("no RabbitMQ vhost: run with --broker amqp or both")
        return self.rabbit.url

    @property
    def broker_url(self) -> str:
        return self.broker_url_of(self.broker)

    @property
    def broker_label(self) -> str:
        return brokers.LABELS[self.broker]

    def _set_broker(self, broker: str) -> None:
        url = self.broker_url_of(broker)
        for side in self.sides:
            side.env["CELERY_BROKER_URL"] = url
            side.settings = dataclasses.replace(side.settings, broker_url=url)
        self.broker = broker

    @contextlib.contextmanager
    def using_broker(self, broker: str):
        """Run what follows with every process of the stack on ``broker`` (its queue emptied before and after)."""
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
        pid = brokers.rabbitmq_pid()
        return {"RabbitMQ": [pid] if pid else []}

    # -- deadlocks -------------------------------------------------------------------------
    def deadlocks(self, *databases: str) -> int:
        """pg_stat_database.deadlocks of these databases (default: every side's) so far."""
        return self._database_counter(COUNTERS.bench_deadlocks, databases)

    def commits(self, *databases: str) -> int:
        """pg_stat_database.xact_commit of these databases (default: every side's) so far."""
        return self._database_counter(COUNTERS.bench_commits_of, databases)

    def _database_counter(self, sql: str, databases: tuple[str, ...]) -> int:
        names = list(databases) or [s.db.name for s in self.sides]
        self.db.q(SQL.bench_stats_clear_snapshot)  # the monitor's own snapshot would repeat its last read
        return int(self.db.one(sql, {"databases": names}))

    def wait_backends_gone(self, application_name: str, timeout_s: float = 10.0) -> None:
        """Until the backends of ``application_name`` have exited (and published their counters)."""
        deadline = time.monotonic() + timeout_s
        while self.db.one(COUNTERS.bench_backends_of, {"application_name": application_name}):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def attempts_deadlocked(self, ids: list[str]) -> int:
        return int(self.db.one(COUNTERS.bench_attempts_deadlocked, {"ids": ids}))

    # -- the peer --------------------------------------------------------------------------
    def peer_home(self) -> Path:
        """The sync engine installed in its cache directory (installed at the first call)."""
        if self._peer_home is None:
            missing = peer.available()
            if missing:
                raise RuntimeError(f"the peer (Stripe's sync engine) needs Node: {missing}; or run with --no-peer")
            self._peer_home = peer.install(log)
        return self._peer_home

    def _side(self, revision: Revision, database: str, migrate_with) -> Side:
        db = BenchDatabase(self.pg.url_for, name=database).create(migrate_with)
        self.cleanup.add(f"monitor connection ({database})", db.close)
        settings = Settings(database_url=db.url, broker_url=self.redis.url, queue_name=QUEUE,
                            webhook_secrets=(SECRET,))
        env = revision.checkout.env(db.url, self.redis.url, {
            "STRIPE_WEBHOOK_SECRET": SECRET, "LEDGER_QUEUE": QUEUE,
            "STRIPE_SIGNATURE_TOLERANCE_S": str(SIGNATURE_TOLERANCE_S)})
        return Side(revision, db, env, settings)

    @property
    def baseline(self) -> Side | None:
        """The older revision of ``--compare``, if any."""
        return next((s for s in self.sides if not s.revision.current and not s.revision.floor), None)

    @property
    def db(self) -> BenchDatabase:
        return self.side.db

    @property
    def env(self) -> dict[str, str]:
        return self.side.env

    @property
    def settings(self) -> Settings:
        return self.side.settings

    @property
    def results(self) -> dict[str, Any]:
        return self.side.results if self.side else self._unstarted

    @property
    def pg_parts(self) -> dict:
        return url_parts(self.db.url)

    @property
    def checkout(self) -> Checkout:
        return self.side.revision.checkout

    @contextlib.contextmanager
    def using(self, side: Side):
        """Run what follows against ``side``: its database, its revision's processes."""
        previous = self.side
        if side is not previous:
            self.stop_receiver()
            self.drop_queue()
        self.side = side
        try:
            yield side
        finally:
            if side is not previous:
                self.stop_receiver()
            self.side = previous

    def receiver(self) -> Receiver:
        if self._receiver is None:
            log(f"starting the receiver ({report.receiver_kind(self.opts.receiver_server, self.opts.receiver_workers, self.opts.receiver_threads)})"
                + ("" if self.side.revision.current else f" of {self.side.label}"))
            self._receiver = self.checkout.adopt(Receiver(self.env, self.work, server=self.opts.receiver_server,
                                                          workers=self.opts.receiver_workers,
                                                          threads=self.opts.receiver_threads, ready_path="/readyz",
                                                          extra_args=("--backlog", "2048")))
            self.cleanup.add("receiver", self._receiver.stop)
            self._receiver.start()
        return self._receiver

    def stop_receiver(self) -> None:
        """Stop the shared receiver (the next ``receiver()`` starts the active side's)."""
        if self._receiver is not None:
            self.note_rss(ProcessWatch(self._receiver.pids).peak_rss_mb())
            self._receiver.stop()
            self.cleanup.remove(self._receiver.stop)
            self._receiver = None

    @property
    def source(self) -> EventSource:
        if self._source is None:
            # Generated once and re-issued under fresh ids as often as a backlog needs (EventSource.backlog).
            count = min(4000, max(self.opts.drain_events, self.opts.burst_events, self.opts.replay_events))
            log(f"generating {count // 10} subscription lifecycles ({count} events)")
            self._source = EventSource(payloads.lifecycles(count // 10))
        return self._source

    @property
    def steady_source(self) -> EventSource:
        """Basil-era (2025-03-31) lifecycles for steady, re-issued under fresh ids per level."""
        if self._steady_source is None:
            count = min(4000, self.opts.steady_events)
            log(f"generating {count // 10} basil-era subscription lifecycles ({count} events)")
            self._steady_source = EventSource(payloads.lifecycles(count // 10, seed=13,
                                                                  api_version=payloads.BASIL_API))
        return self._steady_source

    @property
    def templates(self):
        if self._templates is None:
            self._templates = payloads.ingest_templates(lifecycle_count=4)
        return self._templates

    def readme_fleet(self):
        """The documented pools (docs/configuration.md): 2 ``celery -A workers worker --concurrency 2`` (steady's)."""
        return self.fleet(README_POOLS["workers"], label="readme", concurrency=README_POOLS["concurrency"],
                          readme=True)

    @contextlib.contextmanager
    def fleet(self, count: int, label: str = "w", nice: int = 0, *, concurrency: int = 1, readme: bool = False):
        fleet = WorkerFleet(self.env, self.work, count=count, queue=QUEUE, label=label, nice=nice,
                            concurrency=concurrency, readme=readme, checkout=self.checkout)
        self.cleanup.add(f"{count} workers", fleet.stop)
        try:
            fleet.start()
            yield fleet
        finally:
            self.note_rss(ProcessWatch(fleet.pids).peak_rss_mb())
            fleet.stop()
            self.cleanup.remove(fleet.stop)

    def note_rss(self, peaks: dict[str, float]) -> None:
        for name, mb in peaks.items():
            self.peak_rss[name] = max(self.peak_rss.get(name, 0.0), mb)

    def finish(self) -> None:
        if self._receiver is not None:
            self.note_rss(ProcessWatch(self._receiver.pids).peak_rss_mb())

    # -- state -----------------------------------------------------------------------------
    def clear(self) -> None:
        """Empty ledger: truncate everything. With history: delete what is not history (unfinished rows)."""
        self.drop_queue()
        if self.label == "empty":
            self.db.reset()
        else:
            self.db.q(SQL.bench_delete_unfinished)
            # Back to the state TRUNCATE gives the empty ledger: unprocessed-set partial indexes
            # holding only live rows, so the comparison isolates the history (see docs: churn).
            self.db.vacuum("ledger.events", "ledger.deliveries", index_cleanup=True)

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
        """A delivery of each thin notification to /webhooks/stripe/thin, signed now with the destination's secret."""
        now = int(time.time())
        out = []
        for note in notifications:
            text = payloads.body(note)
            out.append(SignedDelivery(note["id"], text, payloads.sign(text, THIN_SECRET, timestamp=now),
                                      path=payloads.THIN_PATH))
        return out

    def meter(self, groups: Callable[[], dict[str, list[int]]]) -> "Meter":
        return Meter(self, groups)


class Meter:
    """Per-event cost over a phase: statements, transactions, Redis commands, CPU.

    Postgres 15 backends publish their transaction counters lazily (up to 10 s after
    going idle), so the caller makes the measured backends exit before ``begin`` and
    before ``finish`` (stops the workers, or ends the receiver's connections; its pool
    opens new ones); backends flush their counters when they exit. SQL-side figures
    are per call of the ``anchor`` statement (the receiver's: one per delivery) or, with
    no anchor, per event counted by ``progress`` (the workers'); CPU per event counted by
    ``progress`` over the CPU window.
    """

    def __init__(self, bench: Bench, groups: Callable[[], dict[str, list[int]]]):
        self.b = bench
        self.watch = ProcessWatch(groups)

    def begin_sql(self) -> None:
        db = self.b.db
        db.reset_statements()
        self.x0 = db.xact_commits()
        self.m0 = db.monitor_statements
        self.r0 = self.b.broker_commands()

    def _wire(self) -> dict[tuple[int, int], tuple[int, int]]:
        return wire_segments([pid for pids in self.watch.groups().values() for pid in pids], self.b.pg.port)

    def begin_cpu(self, progress: Callable[[], int]) -> None:
        self.pg0 = self.b.pg.cpu_s()
        self.watch.begin()
        self.w0 = self._wire()
        self.t0 = time.monotonic()
        self.p0 = progress()

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
        monitor = db.monitor_statements - self.m0
        xacts = db.xact_commits() - self.x0 - monitor - 1  # minus the benchmark's own reads
        redis = {k: v - self.r0.get(k, 0) for k, v in r1.items() if k != "info" and v - self.r0.get(k, 0)}
        calls = sum(s["calls"] for s in statements)
        # None: per processed event (a set-based finish covers a whole batch in one call).
        events = (sum(s["calls"] for s in statements if s["name"] == anchor) if anchor else 0) or max(self.cpu_events, 1)
        by_name: dict[str, float] = {}
        exec_ms: dict[str, float] = {}
        for s in statements:
            by_name[s["name"]] = by_name.get(s["name"], 0) + s["calls"] / events
            exec_ms[s["name"]] = exec_ms.get(s["name"], 0) + s["exec_ms"] / events
        n = max(self.cpu_events, 1)
        return {"events": events, "cpu_events": self.cpu_events, "elapsed_s": self.elapsed,
                "statements_per_event": calls / events, "round_trips_per_event": self.wire_in / n,
                "client_writes_per_event": self.wire_out / n,
                "transactions_per_event": xacts / events,
                "statements_by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1])),
                "exec_ms_by_name": dict(sorted(exec_ms.items(), key=lambda kv: -kv[1])),
                "redis_commands_per_event": sum(redis.values()) / events,
                "redis_by_command": {k: v / events for k, v in sorted(redis.items(), key=lambda kv: -kv[1])},
                "cpu_ms_per_event": {k: 1000 * v / n for k, v in self.cpu.items()},
                "postgres_cpu_ms_per_event": 1000 * self.pg_cpu / n,
                "cpu_s": self.cpu, "postgres_cpu_s": self.pg_cpu}


def end_backends(b: Bench, application_name: str) -> None:
    """Make a process's Postgres backends exit (they publish their counters as they do)."""
    b.db.q(SQL.bench_backends_terminate, {"application_name": application_name})
    deadline = time.monotonic() + 10
    while b.db.one(SQL.bench_backends_count, {"application_name": application_name}):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)


# -- ingest -------------------------------------------------------------------------------------

def ingest(b: Bench) -> dict[str, Any]:
    opts = b.opts
    rc = b.receiver()
    b.clear()
    templates = b.templates
    log(f"ingest [{b.label}]: {len(templates)} payload templates "
        f"({payloads.size_stats(payloads.body(t) for t in templates)})")
    b.wrk.run(rc.port, b.deliveries(templates, 400, seed=99), 8, max_duration_s=30)  # warm-up, not measured
    sample = b.deliveries(templates, 8, seed=7)
    scripts, defines = ingest_scripts(b.work, sample)
    rows = []
    estimate = 500.0
    cost = None
    for c in opts.levels:
        count = int(min(60_000, max(1_500, estimate * opts.ingest_s * 1.8)))
        deliveries = b.deliveries(templates, count, seed=c)
        before = b.db.unfinished()
        metered = c == 8 and "cost_receiver" not in b.results.get("_meters", {}).get(b.label, {})
        meter = b.meter(rc.pids) if metered else None
        if meter:
            end_backends(b, "ingest")
            meter.begin_sql()
            meter.begin_cpu(b.db.unfinished)
        r = b.wrk.run(rc.port, deliveries, c, max_duration_s=opts.ingest_s)
        if meter:
            meter.end_cpu(b.db.unfinished)
            time.sleep(0.5)  # the last answers in flight
            end_backends(b, "ingest")
            cost = meter.finish("event_record_delivery")
            b.results.setdefault("_meters", {}).setdefault(b.label, {})["cost_receiver"] = cost
        recorded = b.db.unfinished() - before
        b.drop_queue()
        estimate = max(estimate, r.rps)
        pgb = run_pgbench(b.pg_parts, scripts, c, seconds=opts.ingest_s, defines=defines, log_dir=b.work)
        row = {"concurrency": c, "requests": r.requests, "recorded": recorded, "rps": r.rps,
               "p50_ms": r.p50_ms, "p95_ms": r.p95_ms, "p99_ms": r.p99_ms, "max_ms": r.max_ms,
               "errors": r.errors + max(0, r.requests - recorded), "wrk_cpu_pct": r.wrk_cpu_pct,
               "pgbench_tps": pgb.tps, "pgbench_p50_ms": pgb.p50_ms, "pgbench_p99_ms": pgb.p99_ms,
               "pgbench_cpu_pct": 100 * pgb.cpu_s / pgb.duration_s if pgb.duration_s else 0.0,
               "ingest_ratio": r.rps / pgb.tps if pgb.tps else 0.0}
        rows.append(row)
        log(f"  c={c:<3} receiver {r.rps:8.1f} req/s p50 {r.p50_ms:6.1f} ms p99 {r.p99_ms:7.1f} ms "
            f"errors {row['errors']} | pgbench {pgb.tps:8.1f} tps | ratio {row['ingest_ratio']:.3f}")
    b.clear()
    return {"levels": rows, "payload": payloads.size_stats(d.body for d in sample + b.deliveries(templates, 500, 3)),
            "receiver_server": opts.receiver_server, "receiver_workers": opts.receiver_workers,
            "receiver_threads": opts.receiver_threads,
            "seconds_per_level": opts.ingest_s,
            "loadgen": "wrk 4 (1 thread, pre-signed requests replayed by a Lua script)"}


# -- drain --------------------------------------------------------------------------------------

def _wait_drained(b: Bench, expected: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while b.db.unfinished() > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"backlog not drained within {timeout_s:.0f}s ({b.db.unfinished()} left)")
        time.sleep(0.25)


def _run_stats(b: Bench, ids: list[str]) -> dict[str, Any]:
    row = b.db.q(SQL.bench_run_stats, {"ids": ids})[0]
    processed, other, first, last, oldest, first_received = row
    return {"processed": processed, "not_processed": other, "first_claim": float(first or 0),
            "last_processed": float(last or 0), "max_wait_s": float(oldest or 0),
            "first_received": float(first_received or 0)}


# The documented pools (docs/configuration.md) (steady's): 2 `celery -A workers worker --concurrency 2`, 4 pool processes.
README_POOLS = {"workers": 2, "concurrency": 2}
README_POOLS_LABEL = "2×2 (README)"


def _drain_workers(b: Bench, n_events: int, workers: int, *, readme: bool) -> dict[str, Any]:
    """One drain on the active broker: a fresh backlog (rows and wake-ups in place), then the workers;
    the rate and the machine's busy share over the window (or the whole drain with --full-drain)."""
    opts = b.opts
    events = b.fresh_backlog(n_events)
    ids = [e.id for e in events]
    load_received(b.db.url, events)
    b.push_wakeups(ids)
    what = (f"{README_POOLS['workers']} README workers (--concurrency {README_POOLS['concurrency']})" if readme
            else f"{workers} worker process(es)")
    log(f"drain [{b.label}, {b.broker_label}]: {n_events:,} received events, {what}")
    done = lambda: n_events - b.db.unfinished()  # noqa: E731
    metered = (not readme and workers == 1 and b.broker == b.opts.brokers[0]
               and "cost_worker" not in b.results.get("_meters", {}).get(b.label, {}))
    meter = None
    if metered:
        holder: dict = {}
        meter = Meter(b, lambda: holder["fleet"].pids())
        meter.begin_sql()  # before any worker exists: its counters start from zero
    deadlocks0 = b.deadlocks()
    machine = MachineCpu()
    fleet_of = b.readme_fleet() if readme else b.fleet(workers)
    with fleet_of as fleet:
        if meter:
            holder["fleet"] = fleet
        time.sleep(opts.drain_warmup_s)
        if meter:
            meter.begin_cpu(done)
        # Ours, beside the machine's: the workers', Postgres' and the broker's CPU over the window.
        ours = ProcessWatch(lambda: {**fleet.pids(), **b.broker_group()})
        ours.begin()
        pg0 = b.pg.cpu_s()
        p0, t0 = done(), time.monotonic()
        machine.begin()
        if opts.full_drain:
            _wait_drained(b, n_events, timeout_s=max(600, n_events / 5))
        else:
            time.sleep(opts.drain_s)
        p1, t1 = done(), time.monotonic()
        cpu = machine.end()
        stack_cpu = {**ours.cpu_s(), "Postgres": b.pg.cpu_s() - pg0}
        if meter:
            meter.end_cpu(done)
        log_deadlocks = fleet.log_mentions("DeadlockDetected")
    b.wait_backends_gone("worker")
    if meter:  # the workers have exited: their counters are published
        b.results.setdefault("_meters", {}).setdefault(b.label, {})["cost_worker"] = \
            meter.finish(None)
    failed = b.db.one(SQL.bench_events_failed_count, {"ids": ids})
    eps = (p1 - p0) / (t1 - t0)
    run = {"workers": README_POOLS_LABEL if readme else workers, "broker": b.broker,
           "processes": README_POOLS["workers"] * README_POOLS["concurrency"] if readme else workers,
           "events": n_events, "processed": p1 - p0, "errors": failed, "seconds": t1 - t0, "events_per_s": eps,
           "busy": cpu["busy"], "iowait": cpu["iowait"],
           "stack_busy": sum(stack_cpu.values()) / ((t1 - t0) * (os.cpu_count() or 1)),
           "cpu_ms_per_event": {k: 1000 * v / max(p1 - p0, 1) for k, v in stack_cpu.items()},
           "deadlocks": b.deadlocks() - deadlocks0, "attempts_deadlocked": b.attempts_deadlocked(ids),
           "log_deadlocks": log_deadlocks, "mix": _mix(events)}
    log(f"  {b.broker_label}: {eps:8.1f} events/s ({p1 - p0} in {t1 - t0:.1f}s), machine {100 * cpu['busy']:.0f}% "
        f"busy (iowait {100 * cpu['iowait']:.0f}%; workers, Postgres and broker {100 * run['stack_busy']:.0f}%), "
        f"deadlocks {run['deadlocks']} (attempts "
        f"{run['attempts_deadlocked']}), errors {failed}")
    return run


def _mix(events: list[BacklogEvent]) -> dict[str, int]:
    mix: dict[str, int] = {}
    for e in events:
        mix[e.type] = mix.get(e.type, 0) + 1
    return mix


def _drain_limit(b: Bench, n_events: int, clients: int) -> dict[str, Any]:
    """pgbench sending the workers' statements for a fresh copy of the backlog, ``clients`` at once."""
    opts = b.opts
    limit_events = b.fresh_backlog(n_events)
    load_received(b.db.url, limit_events)
    script = DrainScript(limit_events)
    script.load(b.db.url)
    path = b.work / "drain.sql"
    path.write_text(script.text())
    defines = {"i": "0", "nclients": str(clients), "lease_s": "120"}
    if opts.full_drain:
        pgb = run_pgbench(b.pg_parts, [path], clients, transactions_per_client=n_events // clients,
                          defines=defines, log_dir=b.work)
    else:
        pgb = run_pgbench(b.pg_parts, [path], clients, seconds=opts.drain_pgbench_s, defines=defines,
                          log_dir=b.work)
    limit_done = b.db.one(SQL.bench_events_processed_count, {"ids": [e.id for e in limit_events]})
    log(f"  pgbench, {clients} client(s): {pgb.tps:8.1f} tps ({limit_done} processed)")
    return {"pgbench_tps": pgb.tps, "pgbench_processed": limit_done, "pgbench_failed": pgb.failed,
            "pgbench_statements_per_event": script.statements_per_event()}


def drain(b: Bench) -> dict[str, Any]:
    """Workers on a 20,000-event backlog, then pgbench on a fresh copy of it, per worker count; then the
    documented pools (2 workers of 2 pool processes). Each fleet drains once per broker (--broker),
    taking turns; pgbench once per fleet.

    The rate is taken over a window (``drain_s``) once every worker is up, with the
    whole backlog in place; ``--full-drain`` drains it to the end instead. Over the same
    window: the machine's busy share (/proc/stat), and the deadlocks Postgres detected.
    """
    opts = b.opts
    n_events = opts.drain_events
    by_broker: dict[str, dict[str, Any]] = {br: {"runs": [], "readme": None} for br in opts.brokers}
    fleets = [(w, False) for w in opts.worker_counts] + [(README_POOLS["workers"], True)]
    mix: dict[str, int] = {}
    for workers, readme in fleets:
        per_broker = {}
        for broker in opts.brokers:
            with b.using_broker(broker):
                per_broker[broker] = _drain_workers(b, n_events, workers, readme=readme)
        clients = README_POOLS["workers"] * README_POOLS["concurrency"] if readme else workers
        limit = _drain_limit(b, n_events, clients)
        for broker, run in per_broker.items():
            mix = run.pop("mix")
            run.update(limit)
            run["drain_ratio"] = run["events_per_s"] / limit["pgbench_tps"] if limit["pgbench_tps"] else 0.0
            if readme:
                by_broker[broker]["readme"] = run
            else:
                by_broker[broker]["runs"].append(run)
    b.clear()
    first = opts.brokers[0]
    sample = b.source.backlog(min(n_events, 1000))
    return {"runs": by_broker[first]["runs"], "readme": by_broker[first]["readme"], "broker": first,
            "brokers": by_broker, "events": n_events, "mix": mix, "full_drain": opts.full_drain,
            "window_s": opts.drain_s, "pgbench_window_s": opts.drain_pgbench_s,
            "readme_pools": README_POOLS, "payload": payloads.size_stats(e.body for e in sample)}


# -- burst --------------------------------------------------------------------------------------

class _Poller(threading.Thread):
    """Samples backlog depth and oldest-unprocessed age on a connection of its own."""

    def __init__(self, url: str, interval_s: float = 0.25):
        super().__init__(daemon=True)
        self.url = url
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, float]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._halt.is_set():
                depth, age = conn.execute(SQL.bench_backlog_depth_and_age).fetchone()
                self.samples.append((time.time(), depth, float(age)))
                self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


def _corr(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 3 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return 0.0
    return statistics.correlation(xs, ys)


def _ensure_recorded(b: Bench, rc: Receiver, deliveries: list[SignedDelivery], *, settle_s: float = 1.5) -> int:
    """Wait until every delivery has its ledger row; send again those that never arrived. Returns how many."""
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
    raise RuntimeError(f"{len(missing)} burst deliveries never recorded")


def _ack_vs_backlog(b: Bench, rc: Receiver) -> dict[str, Any]:
    """The control: the same ingest (c=32, no worker running) with no backlog, then with a
    backlog as large as the drain's (rows and wake-ups in place)."""
    seconds = max(2.0, b.opts.ingest_s / 2)
    out = {}
    for name, backlog in (("no_backlog", 0), ("backlog", b.opts.drain_events)):
        b.clear()
        if backlog:
            events = b.source.backlog(backlog)
            load_received(b.db.url, events)
            b.push_wakeups([e.id for e in events])
        r = b.wrk.run(rc.port, b.deliveries(b.templates, int(600 * seconds), seed=40 + backlog % 7),
                      b.opts.burst_connections, max_duration_s=seconds)
        out[name] = {"backlog": backlog, "rps": r.rps, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors}
    out["rps_ratio"] = out["backlog"]["rps"] / out["no_backlog"]["rps"] if out["no_backlog"]["rps"] else 0.0
    out["p99_ratio"] = out["backlog"]["p99_ms"] / out["no_backlog"]["p99_ms"] if out["no_backlog"]["p99_ms"] else 0.0
    log(f"  control (no workers, c={b.opts.burst_connections}): backlog 0 -> {out['no_backlog']['rps']:.0f} req/s "
        f"p99 {out['no_backlog']['p99_ms']:.0f} ms; backlog {b.opts.drain_events:,} -> {out['backlog']['rps']:.0f} "
        f"req/s p99 {out['backlog']['p99_ms']:.0f} ms")
    b.clear()
    return out


def burst(b: Bench) -> dict[str, Any]:
    opts = b.opts
    rc = b.receiver()
    events = b.fresh_backlog(opts.burst_events)
    deliveries = b.signed(events)
    segments = 10
    size = len(deliveries) // segments
    log(f"burst: {len(deliveries)} deliveries at c={opts.burst_connections} while 2 workers run"
        f" (nice {opts.burst_worker_nice})")
    deadlocks0 = b.deadlocks()
    with b.fleet(2, label="burst", nice=opts.burst_worker_nice) as fleet:
        poller = _Poller(b.db.monitor_url)
        poller.start()
        try:
            started = time.time()
            rows = []
            for k in range(segments):
                chunk = deliveries[k * size:(k + 1) * size if k < segments - 1 else len(deliveries)]
                depth_before = b.db.unfinished()
                r = b.wrk.run(rc.port, chunk, opts.burst_connections, max_duration_s=600)
                depth_after = b.db.unfinished()
                rows.append({"segment": k + 1, "backlog_before": depth_before, "backlog_after": depth_after,
                             "rps": r.rps, "p50_ms": r.p50_ms, "p95_ms": r.p95_ms, "p99_ms": r.p99_ms,
                             "errors": r.errors, "requests": r.requests})
            # Acknowledged means committed (the receiver answers only after COMMIT): wait for every
            # row. The last requests of a segment may still be in flight when wrk stops timing, and
            # wrk occasionally drops a request its Lua script handed it (it asks for another when
            # a first write would block): those are sent again, counted in resent.
            resent = _ensure_recorded(b, rc, deliveries)
            acked = time.time()
            _wait_drained(b, len(events), timeout_s=max(300, len(events) / 10))
        finally:
            poller.stop()
        log_deadlocks = fleet.log_mentions("DeadlockDetected")
    b.wait_backends_gone("worker")
    deadlocks = {"deadlocks": b.deadlocks() - deadlocks0,
                 "attempts_deadlocked": b.attempts_deadlocked([e.id for e in events]), "log_deadlocks": log_deadlocks}
    stats = _run_stats(b, [e.id for e in events])
    control = _ack_vs_backlog(b, rc)
    depth_mid = [(r["backlog_before"] + r["backlog_after"]) / 2 for r in rows]
    p50s, p99s, rps = [r["p50_ms"] for r in rows], [r["p99_ms"] for r in rows], [r["rps"] for r in rows]
    low = [r for r in rows if (r["backlog_before"] + r["backlog_after"]) / 2 <= statistics.median(depth_mid)]
    high = [r for r in rows if r not in low]
    result = {
        "deliveries": len(deliveries), "connections": opts.burst_connections, "workers": 2,
        "worker_nice": opts.burst_worker_nice,
        "segments": rows,
        "ack_all_s": acked - started,
        "processed_all_s": stats["last_processed"] - started,
        "ack_rps": len(deliveries) / (acked - started),
        "processed_rps": stats["processed"] / (stats["last_processed"] - started) if stats["last_processed"] else 0,
        "peak_oldest_unprocessed_s": stats["max_wait_s"],
        "peak_oldest_unprocessed_sampled_s": max((s[2] for s in poller.samples), default=0.0),
        "peak_backlog": max((s[1] for s in poller.samples), default=0),
        "errors": sum(r["errors"] for r in rows) + stats["not_processed"], "resent": resent,
        "corr_backlog_p50": _corr(depth_mid, p50s), "corr_backlog_p99": _corr(depth_mid, p99s),
        "corr_backlog_rps": _corr(depth_mid, rps),
        "p50_ms_low_backlog": statistics.median(r["p50_ms"] for r in low) if low else 0,
        "p50_ms_high_backlog": statistics.median(r["p50_ms"] for r in high) if high else 0,
        "p99_ms_low_backlog": statistics.median(r["p99_ms"] for r in low) if low else 0,
        "p99_ms_high_backlog": statistics.median(r["p99_ms"] for r in high) if high else 0,
        "timeline": [(t - started, depth, age) for t, depth, age in poller.samples],
        "control": control, "broker": b.broker, **deadlocks,
    }
    log(f"  acked all in {result['ack_all_s']:.1f}s, processed all in {result['processed_all_s']:.1f}s, "
        f"peak oldest unprocessed {result['peak_oldest_unprocessed_s']:.1f}s, peak backlog {result['peak_backlog']}, "
        f"deadlocks {result['deadlocks']} (attempts {result['attempts_deadlocked']})")
    b.clear()
    return result


# -- replay -------------------------------------------------------------------------------------

def replay(b: Bench) -> dict[str, Any]:
    opts = b.opts
    rc = b.receiver()
    events = b.fresh_backlog(opts.replay_events)
    load_received(b.db.url, events, status_sql=SQL.bench_seed_failed_permanent)
    b.db.vacuum("ledger.events")
    templates = b.templates
    b.wrk.run(rc.port, b.deliveries(templates, 300, seed=98), 8, max_duration_s=30)  # warm-up
    log(f"replay: live ingest alone (c=8, {opts.ingest_s:.0f}s)")
    base = b.wrk.run(rc.port, b.deliveries(templates, 40_000 if not opts.quick else 8_000, seed=21), 8,
                     max_duration_s=opts.ingest_s)
    b.drop_queue()
    log(f"replay: ledgerctl replay of {len(events)} failed_permanent events, live ingest (c=8) alongside")
    # The live ingest starts first and the replay once deliveries are being recorded, so the
    # replay runs entirely inside it; its rate during the replay is read from the rows.
    cmd = [b.checkout.tool("ledgerctl"), "replay", "--status", "failed_permanent", "--yes", "--rate", "1000000",
           "--why", "benchmark", "--json"]
    started: dict[str, subprocess.Popen] = {}
    box: dict[str, Any] = {}
    live_count = max(5_000, int(base.rps * 40)) if not opts.quick else 10_000

    def live_ingest() -> None:
        try:
            box["live"] = b.wrk.run(rc.port, b.deliveries(templates, live_count, seed=22), 8, max_duration_s=600,
                                    stop_when=lambda: "proc" in started and started["proc"].poll() is not None,
                                    poll_s=0.05)
        except BaseException as exc:  # reported by the main thread
            box["error"] = exc

    recorded_before = b.db.one(SQL.bench_events_count)
    thread = threading.Thread(target=live_ingest, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while b.db.one(SQL.bench_events_count) < recorded_before + 200:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the live ingest did not start: {box.get('error')}")
        time.sleep(0.05)
    with open(b.work / "replay.log", "wb") as out:
        proc = subprocess.Popen(cmd, env=b.env, cwd=b.checkout.root, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    started["proc"] = proc
    b.cleanup.add("ledgerctl replay", proc.kill)
    try:
        proc.wait(timeout=600)
        thread.join(timeout=120)
        if "error" in box or "live" not in box:
            raise RuntimeError(f"live ingest during the replay failed: {box.get('error')}")
        live = box["live"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        b.cleanup.remove(proc.kill)
    replay_ids = [e.id for e in events]
    live_during = b.db.one(SQL.bench_live_events_during_replay, {"ids": replay_ids})
    first, last, replayed = b.db.q(SQL.bench_replay_window)[0]
    seconds = float(last - first) if replayed > 1 else 0.0
    live_rps_during = live_during / seconds if seconds else live.rps
    result = {"events": len(events), "replayed": replayed, "exit_code": proc.returncode,
              "seconds": seconds, "events_per_s": replayed / seconds if seconds else 0.0,
              "live_rps_alone": base.rps,
              "live_rps_during": live_rps_during,
              "live_rps_wrk_run": live.rps,
              "live_p50_ms_alone": base.p50_ms, "live_p50_ms_during": live.p50_ms,
              "live_p99_ms_alone": base.p99_ms, "live_p99_ms_during": live.p99_ms,
              "live_errors": base.errors + live.errors,
              "live_slowdown": 1 - live_rps_during / base.rps if base.rps else 0.0,
              "rate_option": "--rate 1000000 (unthrottled; the default is 50/s)"}
    log(f"  replayed {replayed} in {seconds:.1f}s ({result['events_per_s']:.0f}/s); live ingest "
        f"{base.rps:.0f} -> {live_rps_during:.0f} req/s (slowdown {100 * result['live_slowdown']:.0f}%)")
    b.clear()
    return result


# -- steady -------------------------------------------------------------------------------------

# Of the deliveries of each steady level, the share that are redeliveries of an event already sent.
STEADY_REDELIVERY_SHARE = 0.05


def with_redeliveries(deliveries: list[SignedDelivery], share: float, *, seed: int) -> list[SignedDelivery]:
    """``deliveries`` with redeliveries mixed in, ``share`` of the result: each repeats an earlier
    delivery (same body) at a uniformly random later position, so some find their event
    still waiting or in progress and most find it processed."""
    rng = random.Random(seed)
    keyed = [(float(i), d) for i, d in enumerate(deliveries)]
    for _ in range(round(len(deliveries) * share / (1 - share))):
        i = rng.randrange(len(deliveries) - 1)
        keyed.append((rng.uniform(i + 0.5, len(deliveries)), deliveries[i]))
    keyed.sort(key=lambda kv: kv[0])
    return [d for _, d in keyed]


def _wait_processed(b: Bench, rc: Receiver, unique: list[SignedDelivery], timeout_s: float) -> int:
    """Every delivery has its row (those that never left wrk are sent again: returned) and none is unfinished."""
    resent = 0
    if b.db.one(SQL.bench_events_count) < len(unique):
        resent = _ensure_recorded(b, rc, unique)
    deadline = time.monotonic() + timeout_s
    while b.db.unfinished() > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"steady: events not processed within {timeout_s:.0f}s ({b.db.unfinished()} left)")
        time.sleep(0.05)
    return resent


class ThinApi:
    """The Stripe API of a thin level: a fake (``python -m devkit.stripe_api``) started with every object
    and v2 event the level's notifications name, and the workers' settings that point at it."""

    def __init__(self, b: Bench, loads: list[payloads.ThinLoad], name: str):
        state = FakeStripe(DEFAULT_API_KEY)
        for load in loads:
            state.put_objects(load.objects)
            for v2 in load.v2_events:
                state.add_v2_event(v2)
        path = b.work / f"{name}-state.json"
        path.write_text(json.dumps(state.state()))
        self.process = FakeStripeProcess(b.work, state=path, latency_ms=b.opts.thin_latency_ms)
        self._fetch_concurrency = b.opts.fetch_concurrency

    def start(self) -> "ThinApi":
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop(grace_s=5)

    def env(self) -> dict[str, str]:
        env = {"STRIPE_THIN_WEBHOOK_SECRET": THIN_SECRET, "STRIPE_API_KEY": self.process.api_key,
               "STRIPE_API_BASE": self.process.base_url}
        if self._fetch_concurrency is not None:
            env["STRIPE_FETCH_CONCURRENCY"] = str(self._fetch_concurrency)
        return env

    def requests(self) -> dict[str, Any]:
        """What the workers asked the fake since the last ``clear``: counts by kind, and the answers that failed."""
        reqs = self.process.control.requests
        return {"requests": len(reqs),
                "v2_events": sum(r.path.startswith("/v2/core/events/") for r in reqs),
                "objects": sum(r.path.startswith("/v1/") for r in reqs),
                "failed": sum((r.status or 0) >= 400 for r in reqs)}


def _steady_level(b: Bench, c: int, payload: str = "snapshot", events: list[BacklogEvent] | None = None,
                  warm_events: list[BacklogEvent] | None = None) -> dict[str, Any]:
    """One level on the active side and broker: a fresh stack, warmed up, on an empty ledger; then every
    delivery sent at concurrency ``c`` and the run timed until every event is processed.

    ``events`` and ``warm_events``: the level's stream (the same for every broker, revision and the
    peer), signed now; new ones when not given. ``payload`` "thin": the deliveries are the thin twins
    of the same events, POSTed to /webhooks/stripe/thin, and the workers fetch each from a fake
    Stripe API of this level's own.
    """
    opts = b.opts
    side = b.side.label
    events = events if events is not None else b.steady_source.backlog(opts.steady_events)
    warm_events = warm_events if warm_events is not None else b.steady_source.backlog(200)
    env, api = b.env, None
    if payload == "thin":
        twin = opts.thin_snapshot_twin
        load = payloads.thin_load((json.loads(e.body) for e in events), name_snapshot_twin=twin)
        warm_load = payloads.thin_load((json.loads(e.body) for e in warm_events), name_snapshot_twin=twin)
        unique, warm = b.signed_thin(load.notifications), b.signed_thin(warm_load.notifications)
        api = ThinApi(b, [warm_load, load], f"fake-stripe-{side}-c{c}")
    else:
        unique, warm = b.signed(events), b.signed(warm_events)
    deliveries = with_redeliveries(unique, STEADY_REDELIVERY_SHARE, seed=c)
    b.stop_receiver()  # only this level's stack runs
    tag = "" if payload == "snapshot" else f"{payload}-"
    # Cleanup.remove matches by identity: one bound method each, added and removed.
    stop_api = api.stop if api is not None else None
    try:
        if api is not None:
            b.cleanup.add("fake Stripe API", stop_api)
            api.start()
            env = {**b.env, **api.env()}
        stack = Stack(env, b.work, queue=QUEUE, label=f"steady-{tag}{side}-{b.broker}-c{c}-", checkout=b.checkout,
                      receiver_server=opts.receiver_server, receiver_workers=opts.receiver_workers,
                      receiver_threads=opts.receiver_threads)
        stop_stack = stack.stop
        b.cleanup.add("steady stack", stop_stack)
        try:
            b.clear()
            stack.start()
            rc = stack.receiver
            b.wrk.run(rc.port, warm, 8, max_duration_s=60)  # warm-up: imports, pools, prepared statements
            _wait_processed(b, rc, warm, timeout_s=120)
            b.clear()
            if api is not None:
                api.process.control.clear_requests()
            # Statements, round trips and Redis commands per event too (Meter); not transactions,
            # which Postgres 15 publishes only as the backends exit.
            meter = b.meter(lambda: {**stack.pids(), **b.broker_group()})
            ids = [d.event_id for d in unique]
            processed = lambda: b.db.one(SQL.bench_events_processed_count, {"ids": ids})  # noqa: E731
            meter.begin_sql()
            stack.fleet.mark_logs()
            deadlocks0 = b.deadlocks()
            commits0, monitor0 = b.commits(), b.db.monitor_statements
            self0 = resource.getrusage(resource.RUSAGE_SELF)
            fake0 = cpu_seconds(api.process.pid) if api is not None else 0.0
            wal0 = b.db.one(SQL.bench_wal_lsn)
            held = _held_snapshot(b) if payload == "snapshot-held" else None
            meter.begin_cpu(processed)
            machine = MachineCpu().begin()
            r = b.wrk.run(rc.port, deliveries, c, max_duration_s=600)
            backlog = b.db.unfinished()
            resent = _wait_processed(b, rc, unique, timeout_s=max(300, len(unique) / 10))
            if held is not None:
                held.close()
            busy = machine.end()
            meter.end_cpu(processed)
            wal_bytes = b.db.one(SQL.bench_wal_bytes_since, {"lsn": wal0})
            fake_s = cpu_seconds(api.process.pid) - fake0 if api is not None else 0.0
            self1 = resource.getrusage(resource.RUSAGE_SELF)
            fetches = api.requests() if api is not None else None
            cost = meter.finish(None)
            stats = _run_stats(b, ids)
            rss = ProcessWatch(stack.pids).peak_rss_mb()
            attempts_deadlocked = b.attempts_deadlocked(ids)
            log_deadlocks = stack.fleet.log_mentions("DeadlockDetected")
        finally:
            stop_stack()
            b.cleanup.remove(stop_stack)
        b.wait_backends_gone("worker")
        deadlocks = b.deadlocks() - deadlocks0
        # The bench's own polling commits too (one per monitor statement): not the stack's.
        commits = b.commits() - commits0 - (b.db.monitor_statements - monitor0)
    finally:
        if api is not None:
            stop_api()
            b.cleanup.remove(stop_api)
    cpu = {**meter.cpu, "Postgres": meter.pg_cpu}
    n = max(stats["processed"], 1)
    e2e_s = stats["last_processed"] - r.started_at
    driver_s = (self1.ru_utime - self0.ru_utime) + (self1.ru_stime - self0.ru_stime)
    row = {"concurrency": c, "payload": payload, "broker": b.broker, "deliveries": len(deliveries),
           "events": len(unique),
           "redeliveries": len(deliveries) - len(unique), "processed": stats["processed"],
           "not_processed": stats["not_processed"], "errors": r.errors + stats["not_processed"], "resent": resent,
           "ack_rps": r.rps, "ack_p50_ms": r.p50_ms, "ack_p99_ms": r.p99_ms, "ack_s": r.duration_s,
           "e2e_s": e2e_s, "e2e_eps": stats["processed"] / e2e_s if e2e_s > 0 else 0.0,
           "backlog_at_last_ack": backlog, "max_wait_s": stats["max_wait_s"],
           "cpu_ms": {k: 1000 * v / n for k, v in cpu.items()}, "cpu_ms_total": 1000 * sum(cpu.values()) / n,
           "client_cpu_ms": {"wrk": 1000 * r.wrk_cpu_s / n, "bench driver": 1000 * driver_s / n},
           "wrk_cpu_pct": r.wrk_cpu_pct, "peak_rss_mb": rss, "busy": busy["busy"], "iowait": busy["iowait"],
           "wal_kb_per_event": wal_bytes / 1024 / n, "commits_per_event": commits / n,
           "deadlocks": deadlocks, "attempts_deadlocked": attempts_deadlocked, "log_deadlocks": log_deadlocks,
           **{k: cost[k] for k in ("statements_per_event", "round_trips_per_event", "statements_by_name",
                                   "exec_ms_by_name", "redis_commands_per_event", "redis_by_command")}}
    api_note = ""
    if fetches is not None:
        # The fake stands in for Stripe: its CPU is not the product's (not in the total), like wrk's.
        row["client_cpu_ms"]["fake Stripe API"] = 1000 * fake_s / n
        row["stripe_api"] = {**fetches, "per_event": fetches["requests"] / n,
                             "v2_events_per_event": fetches["v2_events"] / n,
                             "objects_per_event": fetches["objects"] / n}
        api_note = (f" | Stripe API {row['stripe_api']['per_event']:.2f} requests/event "
                    f"({fetches['failed']} failed), fake {row['client_cpu_ms']['fake Stripe API']:.2f} ms/event")
    log(f"  steady [{side}, {b.broker_label}{'' if payload == 'snapshot' else ', ' + payload}] c={c:<3} ack "
        f"{r.rps:7.1f} req/s p50 {r.p50_ms:6.1f} ms p99 {r.p99_ms:7.1f} ms | "
        f"end-to-end {row['e2e_eps']:7.1f} events/s ({stats['processed']} in {e2e_s:.1f}s, backlog at the last "
        f"ack {backlog}) | CPU {row['cpu_ms_total']:.2f} ms/event "
        f"({', '.join(f'{k} {v:.2f}' for k, v in row['cpu_ms'].items())}), WAL {row['wal_kb_per_event']:.1f} KB/event, "
        f"per event {row['statements_per_event']:.2f} statements, {row['round_trips_per_event']:.2f} round trips, "
        f"{row['commits_per_event']:.2f} commits, {row['redis_commands_per_event']:.2f} broker commands, "
        f"machine {100 * row['busy']:.0f}% busy{api_note} | "
        f"deadlocks {deadlocks} (attempts {attempts_deadlocked}) | errors {row['errors']}")
    b.clear()
    return row


# "held": each level twice, the second with a report's transaction open on the ledger the whole run.
STEADY_PAYLOADS = {"snapshot": ("snapshot",), "thin": ("thin",), "both": ("snapshot", "thin"),
                   "held": ("snapshot", "snapshot-held")}


def _held_snapshot(b: Bench) -> psycopg.Connection:
    """A report holding its snapshot: a REPEATABLE READ transaction on the ledger, left open, so that vacuum
    keeps every row version the run makes dead and the claims and the sweep must step over them."""
    conn = psycopg.connect(b.db.url)
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    conn.execute("SELECT count(*) FROM ledger.events").fetchone()
    return conn


def _peer_level(b: Bench, c: int, events: list[BacklogEvent], warm_events: list[BacklogEvent]) -> dict[str, Any]:
    """Stripe's sync engine on the level's stream: a fresh database and server, warmed up (the same
    200 events as the stack's warm-up), emptied; then the same deliveries (same bodies, same
    redeliveries at the same places, signed now) at concurrency ``c``.

    It applies each event inline before answering, so acknowledged is applied: its events/s is
    the events over the time from the first send to the last answer (or to the last row it
    wrote, if later), each event's object checked present in its tables afterwards."""
    home = b.peer_home()
    spec = b.work / f"sync-engine-openapi-c{c}.json"
    spec.write_text(json.dumps(peer.openapi_document(json.loads(e.body) for e in [*warm_events, *events])))
    database = peer.SyncEngineDatabase(b.pg.url_for).create()
    api = FakeStripeProcess(b.work)  # the engine's Stripe client points here: any call it makes is counted
    engine = None
    stop_api = api.stop
    b.cleanup.add("fake Stripe API (peer)", stop_api)
    try:
        api.start()
        engine = peer.SyncEngine(home, b.work, database_url=database.url, secret=SECRET, spec=spec,
                                 path=payloads.SNAPSHOT_PATH, stripe_api_url=api.base_url, name=f"sync-engine-c{c}")
        stop_engine = engine.stop
        b.cleanup.add("sync engine", stop_engine)
        try:
            engine.start()
            b.wrk.run(engine.port, b.signed(warm_events), 8, max_duration_s=60)  # warm-up: JIT, pool, plans
            time.sleep(0.5)  # the warm-up's last answers
            database.empty()
            api.control.clear_requests()
            errors0 = len(engine.errors())
            unique = b.signed(events)
            deliveries = with_redeliveries(unique, STEADY_REDELIVERY_SHARE, seed=c)
            expected = {json.loads(e.body)["data"]["object"]["id"] for e in events}
            tables = sorted(set(peer.TABLES.values()))
            deadlocks0 = b.deadlocks(database.name)
            commits0 = b.commits(database.name)
            b.db.reset_statements()
            wal0 = b.db.one(SQL.bench_wal_lsn)
            pg0, node0 = b.pg.cpu_s(), engine.cpu_s()
            machine = MachineCpu().begin()
            r = b.wrk.run(engine.port, deliveries, c, max_duration_s=600)
            # The last requests in flight when wrk stopped timing: answered in moments.
            deadline = time.monotonic() + 10
            while True:
                missing = expected - database.object_ids(tables)
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            last_write = database.last_write(tables)
            busy = machine.end()
            node_s, pg_s = engine.cpu_s() - node0, b.pg.cpu_s() - pg0
            wal_bytes = b.db.one(SQL.bench_wal_bytes_since, {"lsn": wal0})
            statements = int(b.db.one(COUNTERS.bench_statement_calls_of, {"databases": [database.name]}))
            rows = database.rows(tables)
            requests = api.control.requests
            handler_errors = len(engine.errors()) - errors0
        finally:
            stop_engine()
            b.cleanup.remove(stop_engine)
    finally:
        stop_api()
        b.cleanup.remove(stop_api)
    deadlocks = b.deadlocks(database.name) - deadlocks0
    commits = b.commits(database.name) - commits0  # its backends exited with the engine: published
    database.drop()
    end = max(r.started_at + r.duration_s, last_write or 0.0)
    e2e_s = end - r.started_at
    n = len(unique)
    row = {"concurrency": c, "deliveries": len(deliveries), "events": n, "redeliveries": len(deliveries) - n,
           "ack_rps": r.rps, "ack_p50_ms": r.p50_ms, "ack_p99_ms": r.p99_ms, "ack_s": r.duration_s,
           "e2e_s": e2e_s, "e2e_eps": n / e2e_s if e2e_s > 0 else 0.0,
           "objects": len(expected), "objects_missing": len(missing), "rows": rows,
           "errors": r.errors + handler_errors + len(missing), "handler_errors": handler_errors,
           "stripe_api_requests": len(requests), "deadlocks": deadlocks,
           "busy": busy["busy"], "iowait": busy["iowait"],
           # Counted over its database alone (the checks above read it too: a few statements in all).
           "statements_per_event": statements / n, "commits_per_event": commits / n,
           "wal_kb_per_event": wal_bytes / 1024 / n, "redis_commands_per_event": 0.0,
           "cpu_ms": {"sync engine (node)": 1000 * node_s / n, "Postgres": 1000 * pg_s / n},
           "cpu_ms_total": 1000 * (node_s + pg_s) / n, "client_cpu_ms": {"wrk": 1000 * r.wrk_cpu_s / n}}
    log(f"  steady [sync engine {peer.VERSION}] c={c:<3} ack {r.rps:7.1f} req/s p50 {r.p50_ms:6.1f} ms p99 "
        f"{r.p99_ms:7.1f} ms | acknowledged and applied {row['e2e_eps']:7.1f} events/s ({n} in {e2e_s:.1f}s; "
        f"objects missing {len(missing)}) | CPU {row['cpu_ms_total']:.2f} ms/event, per event "
        f"{row['statements_per_event']:.2f} statements, {row['commits_per_event']:.2f} commits, WAL "
        f"{row['wal_kb_per_event']:.1f} KB, machine "
        f"{100 * busy['busy']:.0f}% busy | Stripe API calls {len(requests)} | deadlocks {deadlocks} | "
        f"errors {row['errors']}")
    return row


def steady(b: Bench) -> dict[str, Any]:
    """The whole stack as docs/configuration.md runs it, fed at each concurrency until every event is processed,
    beside Stripe's sync engine fed the same stream.

    Per level, the same events (and warm-up) for every run: each broker (--broker), each revision
    (--compare: the older one; --floor: the floor; and this checkout), each payload (--payload both:
    snapshot events and their thin twins), then the sync engine (--no-peer: not); so that drift of
    the shared machine hits all alike. Each revision's ``runs`` are its levels of the first payload; ``payload_runs``
    all of them; ``revisions`` are the first broker's, ``brokers`` holds each broker's.
    """
    opts = b.opts
    kinds = STEADY_PAYLOADS[opts.steady_payload]
    with_peer = opts.peer
    if with_peer is None:
        missing = peer.available()
        with_peer = missing is None
        if missing:
            log(f"steady: WITHOUT the sync engine beside it: {missing} (--peer requires it, --no-peer skips it)")
    log(f"steady: {opts.steady_events:,} events per level (+{100 * STEADY_REDELIVERY_SHARE:.0f}% redeliveries), "
        f"concurrency {', '.join(map(str, opts.steady_levels))}; revisions: {', '.join(s.label for s in b.sides)}; "
        f"brokers: {', '.join(brokers.LABELS[br] for br in opts.brokers)}; payload: {', '.join(kinds)}"
        + (f"; beside {peer.PACKAGE_SPEC}" if with_peer else ""))
    if with_peer:
        b.peer_home()  # installed (once) before anything is measured
    runs = {br: {s.label: {k: [] for k in kinds} for s in b.sides} for br in opts.brokers}
    peer_runs: list[dict[str, Any]] = []
    for c in opts.steady_levels:
        events = b.steady_source.backlog(opts.steady_events)
        warm_events = b.steady_source.backlog(200)
        for broker in opts.brokers:
            with b.using_broker(broker):
                for side in b.sides:
                    for kind in kinds:
                        with b.using(side):
                            runs[broker][side.label][kind].append(_steady_level(b, c, kind, events, warm_events))
        if with_peer:
            peer_runs.append(_peer_level(b, c, events, warm_events))
    sample = b.steady_source.backlog(500)
    thin_sample = payloads.thin_load(json.loads(e.body) for e in sample).notifications

    def revisions_on(broker: str) -> list[dict[str, Any]]:
        return [{"label": s.label, "commit": s.revision.commit, "floor": s.revision.floor,
                 "runs": runs[broker][s.label][kinds[0]], "payload_runs": runs[broker][s.label]} for s in b.sides]

    first = opts.brokers[0]
    result = {"levels": list(opts.steady_levels), "events_per_level": opts.steady_events,
              "redelivery_share": STEADY_REDELIVERY_SHARE, "api_version": payloads.BASIL_API,
              "payload": payloads.size_stats(e.body for e in sample),
              "payloads": list(kinds), "thin_snapshot_twin": opts.thin_snapshot_twin, "thin_payload": payloads.size_stats(payloads.body(n) for n in thin_sample),
              "receiver_server": opts.receiver_server, "receiver_workers": opts.receiver_workers,
              "receiver_threads": opts.receiver_threads,
              "workers": 2, "worker_concurrency": 2,
              "loadgen": "wrk 4 (1 thread, pre-signed requests replayed by a Lua script)",
              "broker": first, "revisions": revisions_on(first),
              "brokers": {br: {"revisions": revisions_on(br)} for br in opts.brokers},
              "peer": {"package": peer.PACKAGE_SPEC, "node": peer.node_version(), "pool_max": peer.POOL_MAX,
                       "settings": peer.SETTINGS.format(node=peer.node_version()), "runs": peer_runs}
              if with_peer else None}
    if any(s.revision.floor for s in b.sides):
        result["business_writes"] = report.business_writes(result)
    return result


# -- scale --------------------------------------------------------------------------------------

def _unfinished_set(b: Bench) -> list[str]:
    """A small unprocessed set: 500 overdue received, 300 scheduled retries, 200 live leases."""
    events = b.source.backlog(1000)
    ids = [e.id for e in events]
    load_received(b.db.url, events)
    b.db.q(SQL.bench_seed_overdue_wakeups, {"ids": ids[:500]})
    b.db.q(SQL.bench_seed_scheduled_retries, {"ids": ids[500:800]})
    b.db.q(SQL.bench_seed_live_leases, {"ids": ids[800:]})
    b.db.vacuum("ledger.events")
    return ids


def sweep(b: Bench) -> dict[str, Any]:
    """One recovery sweep pass over a 1,000-event unprocessed set, and the plan of its query."""
    from ledger.db import ProcessPool
    from ledger.attempts import WorkerLedger
    from workers.app import make_celery
    from workers.sweep import Sweeper
    from workers.wakeup import Waker

    b.clear()
    _unfinished_set(b)
    params = {"overdue_s": 15.0, "batch": 500}
    explain = compose(SQL.bench_explain, statement=pg_sql.SQL(LEDGER_SQL.event_sweep_overdue_wakeups))
    timings, plan = [], ""
    with psycopg.connect(b.db.url) as conn:
        for _ in range(15):
            rows = conn.execute(explain, params).fetchall()
            conn.rollback()
            plan = "\n".join(r[0] for r in rows)
            timings.append(float(plan.rsplit("Execution Time: ", 1)[1].split()[0]))
    celery = make_celery(b.settings)
    pool = ProcessPool(b.settings, name="bench-sweep", max_size=1)
    try:
        sweeper = Sweeper(WorkerLedger(pool), Waker(celery), celery, b.settings)
        started = time.perf_counter()
        result = sweeper.run_once()
        pass_ms = 1000 * (time.perf_counter() - started)
    finally:
        pool.close()
        celery.close()
    partial = [r[0] for r in b.db.q(SQL.bench_events_partial_indexes,
                                    {"pattern": "%WHERE (status = ANY%received%processing%"})]
    b.clear()
    out = {"pass_ms": pass_ms, "redriven": result.redriven, "query_ms_median": statistics.median(timings),
           "query_ms_min": min(timings), "plan": plan, "partial_indexes": partial}
    out["uses_partial_index"] = report.sweep_uses_partial(out)
    return out


def history_label(events: int) -> str:
    """How results name a ledger with a history of ``events``: 1M, 3M, 50k."""
    return f"{events // 1_000_000}M" if events % 1_000_000 == 0 else f"{events // 1000}k"


def prefill_history(b: Bench, total: int | None = None, *, days: float = 400.0,
                    step_s: float = 30.0) -> dict[str, Any]:
    """The history (``total`` events, by default --history-events, received ``days`` ago plus
    ``step_s`` per event), written set-based (INSERT ... SELECT generate_series) on two connections at
    once; the events' non-partial secondary indexes are dropped for the load and rebuilt
    from their own definitions, then everything is vacuumed and analysed."""
    total = total or b.opts.history_events
    log(f"writing a history of {total:,} processed events and their business rows (set-based SQL)")
    b.clear()
    sample = b.source.events[0]
    template = payloads.body(sample).replace(sample["id"], "__EVT__").replace(
        sample["data"]["object"]["id"], "__CUS__")
    compact = json.dumps(json.loads(template), separators=(",", ":"))
    events_sql, other_sql, params = history_sql(total, compact, days=days, step_s=step_s)
    rebuilt = b.db.q(SQL.bench_history_secondary_indexes)
    started = time.monotonic()
    errors: list[BaseException] = []

    def run(statements: list[str], params: dict[str, Any] | None = None) -> None:
        try:
            with psycopg.connect(b.db.url, autocommit=True) as conn:
                conn.execute(SQL.bench_bulk_load_replica)
                conn.execute(SQL.bench_bulk_load_memory)
                for statement in statements:
                    conn.execute(statement, params)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    for name, _ in rebuilt:
        b.db.q(compose(SQL.bench_index_drop, index=f"ledger.{name}"))
    threads = [threading.Thread(target=run, args=(events_sql, params)),
               threading.Thread(target=run, args=(other_sql, params))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    index_threads = [threading.Thread(target=run, args=([definition],)) for _, definition in rebuilt]
    for t in index_threads:
        t.start()
    for t in index_threads:
        t.join()
    if errors:
        raise errors[0]
    load_s = time.monotonic() - started
    b.db.vacuum()
    b.db.q(SQL.bench_checkpoint)
    sizes = dict(b.db.q(SQL.bench_relation_sizes))
    counts = {t: b.db.one(compose(SQL.bench_rows, table=t)) for t in
              ("ledger.events", "ledger.attempts", "ledger.deliveries", "billing.customers",
               "billing.subscriptions", "billing.invoices", "billing.subscription_transitions",
               "billing.entitlements")}
    result = {"events": total, "load_s": load_s, "total_s": time.monotonic() - started,
              "payload_bytes": len(compact), "rows": counts, "rebuilt_indexes": [n for n, _ in rebuilt],
              "database_mb": b.db.one(SQL.bench_database_size) / 2**20,
              "relation_mb": {k: v / 2**20 for k, v in sizes.items()}}
    log(f"  history written in {result['load_s']:.0f}s, vacuumed in {result['total_s'] - result['load_s']:.0f}s "
        f"(database {result['database_mb']:.0f} MB)")
    return result


def scale(b: Bench) -> dict[str, Any]:
    # The empty-ledger figures: this run's ingest and drain when they ran before, else measured now.
    empty = b.results.setdefault("_empty", {})
    for name, scenario in (("ingest", ingest), ("drain", drain)):
        if name not in empty:
            empty[name] = b.results.get(name) or scenario(b)
            b.results.setdefault(name, empty[name])
    log("scale: recovery sweep on the empty ledger")
    empty["sweep"] = sweep(b)
    history = prefill_history(b)
    n = b.opts.history_events
    b.label = history_label(n)
    try:
        full_ingest = ingest(b)
        full_drain = drain(b)
        log("scale: recovery sweep with the history")
        full_sweep = sweep(b)
    finally:
        b.label = "empty"
    ingest_ratios = {}
    for e, f in zip(empty["ingest"]["levels"], full_ingest["levels"]):
        c = e["concurrency"]
        ingest_ratios[c] = {"rps": f["rps"] / e["rps"], "p99": e["p99_ms"] / f["p99_ms"] if f["p99_ms"] else 0,
                            "pgbench": f["pgbench_tps"] / e["pgbench_tps"] if e["pgbench_tps"] else 0}
    drain_ratios = {}
    for e, f in zip(empty["drain"]["runs"], full_drain["runs"]):
        drain_ratios[e["workers"]] = {"events_per_s": f["events_per_s"] / e["events_per_s"],
                                      "pgbench": f["pgbench_tps"] / e["pgbench_tps"] if e["pgbench_tps"] else 0}
    es, fs = empty["sweep"], full_sweep
    sweep_ratio = {"pass": es["pass_ms"] / fs["pass_ms"] if fs["pass_ms"] else 0,
                   "query": es["query_ms_median"] / fs["query_ms_median"] if fs["query_ms_median"] else 0}
    figures = [r["rps"] for r in ingest_ratios.values()] + [r["events_per_s"] for r in drain_ratios.values()] \
        + [sweep_ratio["query"]]
    return {"history": history, "ingest": full_ingest, "drain": full_drain, "sweep": full_sweep,
            "sweep_empty": es, "ingest_ratio": ingest_ratios, "drain_ratio": drain_ratios,
            "sweep_ratio": sweep_ratio, "min_ratio": min(figures),
            "target_met": min(figures) >= 0.9}


# -- cost ---------------------------------------------------------------------------------------

def cost(b: Bench) -> dict[str, Any]:
    meters = b.results.get("_meters", {}).get("empty", {})
    if "cost_receiver" not in meters:
        rc = b.receiver()
        b.clear()
        log("cost: metering the receiver (c=8, 3,000 deliveries)")
        b.wrk.run(rc.port, b.deliveries(b.templates, 200, seed=5), 8, max_duration_s=60)
        meter = b.meter(rc.pids)
        end_backends(b, "ingest")
        meter.begin_sql()
        meter.begin_cpu(b.db.unfinished)
        b.wrk.run(rc.port, b.deliveries(b.templates, 3000, seed=6), 8, max_duration_s=120)
        meter.end_cpu(b.db.unfinished)
        time.sleep(0.5)
        end_backends(b, "ingest")
        meters["cost_receiver"] = meter.finish("event_record_delivery")
    if "cost_worker" not in meters:
        b.clear()
        n = min(4000, b.opts.drain_events)
        log(f"cost: metering one worker draining {n} events")
        events = b.source.backlog(n)
        load_received(b.db.url, events)
        b.push_wakeups([e.id for e in events])
        holder: dict = {}
        meter = Meter(b, lambda: holder["fleet"].pids())
        meter.begin_sql()
        done = lambda: n - b.db.unfinished()  # noqa: E731
        with b.fleet(1) as fleet:
            holder["fleet"] = fleet
            meter.begin_cpu(done)
            _wait_drained(b, n, timeout_s=600)
            meter.end_cpu(done)
        meters["cost_worker"] = meter.finish(None)
    b.results.setdefault("_meters", {})["empty"] = meters
    b.clear()
    b.finish()
    return {"receiver": meters["cost_receiver"], "worker": meters["cost_worker"], "peak_rss_mb": dict(b.peak_rss),
            "rss_target_met": all(v < 150 for v in b.peak_rss.values()) if b.peak_rss else None}


# -- receiver-cost ------------------------------------------------------------------------------

def _minimal_receiver(b: Bench) -> Receiver:
    """devkit/benchmarks/minimal_wsgi.py under the receiver's own server and settings (this checkout's
    code, on the active side's database and Redis)."""
    template = wakeup_template(b.broker_url, QUEUE)
    env = {**b.env, "BENCH_WAKEUP_TEMPLATE": json.dumps(template), "PYTHONPATH": str(Checkout().root)}
    rc = Receiver(env, b.work, server=b.opts.receiver_server, workers=b.opts.receiver_workers,
                  threads=b.opts.receiver_threads, ready_path="/readyz", extra_args=("--backlog", "2048"))
    rc.cmd = [arg.replace("ingest.app:create_app", "devkit.benchmarks.minimal_wsgi:create_app") for arg in rc.cmd]
    rc.name = "minimal-wsgi"
    return rc


def _receiver_cost_run(b: Bench, name: str, rc: Receiver, n: int) -> dict[str, Any]:
    """One server: started, warmed up, on an empty ledger; then ``n`` new deliveries at the scenario's
    connections; CPU of its processes (master and workers), Postgres' and Redis' over the run, until
    every delivery has its row (the last ones wrk did not time included)."""
    c = b.opts.receiver_cost_connections
    stop = rc.stop
    b.cleanup.add(name, stop)
    try:
        rc.start()
        b.clear()
        b.wrk.run(rc.port, b.signed(b.steady_source.backlog(min(600, n))), c, max_duration_s=60)  # warm-up
        time.sleep(0.3)
        b.clear()
        deliveries = b.signed(b.steady_source.backlog(n))
        watch = ProcessWatch(rc.pids)
        pg0, broker0 = b.pg.cpu_s(), cpu_seconds(b.redis.pid)
        watch.begin()
        r = b.wrk.run(rc.port, deliveries, c, max_duration_s=600)
        deadline = time.monotonic() + 10
        while b.db.one(SQL.bench_events_count) < len(deliveries) and time.monotonic() < deadline:
            time.sleep(0.05)
        cpu = watch.cpu_s()
        pg_s, broker_s = b.pg.cpu_s() - pg0, cpu_seconds(b.redis.pid) - broker0
        recorded = b.db.one(SQL.bench_events_count)
    finally:
        stop()
        b.cleanup.remove(stop)
    b.clear()
    server_s = sum(cpu.values())
    per = max(recorded, 1)
    run = {"server": name, "requests": len(deliveries), "recorded": recorded, "rps": r.rps,
           "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors + (len(deliveries) - recorded),
           "cpu_s": server_s, "cpu_s_by_process": cpu, "postgres_cpu_s": pg_s, "redis_cpu_s": broker_s,
           "cpu_ms_per_request": 1000 * server_s / per, "postgres_cpu_ms_per_request": 1000 * pg_s / per,
           "redis_cpu_ms_per_request": 1000 * broker_s / per}
    log(f"  {name:<13} {r.rps:7.1f} req/s p50 {r.p50_ms:6.1f} ms p99 {r.p99_ms:7.1f} ms | CPU "
        f"{run['cpu_ms_per_request']:.3f} ms/request (Postgres {run['postgres_cpu_ms_per_request']:.3f}, Redis "
        f"{run['redis_cpu_ms_per_request']:.3f}) | errors {run['errors']}")
    return run


# The target: the receiver's CPU per request within this factor of the minimal WSGI app's.
RECEIVER_COST_TARGET = 1.3


def receiver_cost(b: Bench) -> dict[str, Any]:
    """The receiver's CPU per request next to a minimal WSGI app doing the same I/O (minimal_wsgi.py:
    HMAC check, JSON parse, the receiver's INSERT, one LPUSH of the wake-up), both under the same
    server and settings, fed the same kind of deliveries by the same wrk load, taking turns
    (receiver, minimal, receiver, ...), on Redis."""
    opts = b.opts
    n, c = opts.receiver_cost_requests, opts.receiver_cost_connections
    kind = report.receiver_kind(opts.receiver_server, opts.receiver_workers, opts.receiver_threads)
    log(f"receiver-cost: {n:,} new deliveries per run at c={c}, {opts.receiver_cost_rounds} run(s) per server, "
        f"each under {kind}")
    runs: list[dict[str, Any]] = []
    with b.using_broker("redis"):
        b.stop_receiver()
        for _ in range(opts.receiver_cost_rounds):
            runs.append(_receiver_cost_run(b, "receiver", b.checkout.adopt(Receiver(
                b.env, b.work, server=opts.receiver_server, workers=opts.receiver_workers,
                threads=opts.receiver_threads, ready_path="/readyz", extra_args=("--backlog", "2048"))), n))
            runs.append(_receiver_cost_run(b, "minimal WSGI", _minimal_receiver(b), n))

    def total(name: str) -> dict[str, Any]:
        mine = [r for r in runs if r["server"] == name]
        recorded = max(sum(r["recorded"] for r in mine), 1)
        return {"requests": sum(r["requests"] for r in mine), "recorded": recorded,
                "rps": statistics.fmean(r["rps"] for r in mine), "p99_ms": max(r["p99_ms"] for r in mine),
                "cpu_ms_per_request": 1000 * sum(r["cpu_s"] for r in mine) / recorded,
                "postgres_cpu_ms_per_request": 1000 * sum(r["postgres_cpu_s"] for r in mine) / recorded,
                "redis_cpu_ms_per_request": 1000 * sum(r["redis_cpu_s"] for r in mine) / recorded,
                "errors": sum(r["errors"] for r in mine)}
    receiver, minimal = total("receiver"), total("minimal WSGI")
    ratio = receiver["cpu_ms_per_request"] / minimal["cpu_ms_per_request"] if minimal["cpu_ms_per_request"] else 0.0
    log(f"  receiver CPU per request {receiver['cpu_ms_per_request']:.3f} ms vs minimal WSGI "
        f"{minimal['cpu_ms_per_request']:.3f} ms: {ratio:.2f}× (target ≤ {RECEIVER_COST_TARGET}×)")
    return {"server": kind, "receiver_server": opts.receiver_server, "receiver_workers": opts.receiver_workers,
            "receiver_threads": opts.receiver_threads, "connections": c, "requests_per_run": n,
            "rounds": opts.receiver_cost_rounds, "broker": "redis", "runs": runs, "receiver": receiver,
            "minimal": minimal, "ratio": ratio, "target": RECEIVER_COST_TARGET,
            "loadgen": "wrk 4 (1 thread, pre-signed requests replayed by a Lua script)"}


# -- profile ------------------------------------------------------------------------------------

def _spy(pyspy: str, pids: list[int], seconds: float, out: Path) -> list[tuple[subprocess.Popen, Path]]:
    """One non-blocking py-spy per process (it does not pause them; --subprocesses misses gunicorn's workers)."""
    spies = []
    for pid in pids:
        raw = out.with_name(f"{out.stem}-{pid}.txt")
        spies.append((subprocess.Popen([pyspy, "record", "--pid", str(pid), "--nonblocking", "--rate", "100",
                                        "--format", "raw", "--duration", str(int(seconds)), "-o", str(raw)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       start_new_session=True), raw))
    return spies


def _collect(b: Bench, spies: list[tuple[subprocess.Popen, Path]]) -> list[Path]:
    raws = []
    for proc, raw in spies:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        if raw.exists():
            raws.append(raw)
    return raws


def profile(b: Bench) -> dict[str, Any]:
    """py-spy (sampling, non-blocking, wall clock) on the warmed-up receiver during ingest at c=8,
    and on one worker (its main process and its pool process) during a drain."""
    import shutil

    pyspy = shutil.which("py-spy") or venv_tool("py-spy")
    rc = b.receiver()
    b.clear()
    out = {}
    seconds = 6 if b.opts.quick else 12
    b.wrk.run(rc.port, b.deliveries(b.templates, 600, seed=30), 8, max_duration_s=30)  # warm-up
    spies = _spy(pyspy, rc.children(), seconds, b.work / "profile-receiver.txt")
    time.sleep(0.5)
    r = b.wrk.run(rc.port, b.deliveries(b.templates, int(400 * seconds), seed=31), 8, max_duration_s=seconds - 1)
    raws = _collect(b, spies)
    out["receiver"] = {"rps": r.rps, "profile": report.collapse(raws), "raw": [str(p) for p in raws]}
    b.clear()
    n = 3000 if b.opts.quick else 8000
    events = b.source.backlog(n)
    load_received(b.db.url, events)
    with b.fleet(1) as fleet:
        b.push_wakeups([e.id for e in events[:200]])  # warm-up
        _wait_drained_count(b, n - 200, timeout_s=120)
        pids = fleet.pids()
        spies = _spy(pyspy, pids["worker main"] + pids["worker pool process"], seconds, b.work / "profile-worker.txt")
        time.sleep(0.5)
        b.push_wakeups([e.id for e in events[200:]])
        raws = _collect(b, spies)
    out["worker"] = {"profile": report.collapse(raws), "raw": [str(p) for p in raws]}
    b.clear()
    return out


def _wait_drained_count(b: Bench, remaining: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while b.db.unfinished() > remaining and time.monotonic() < deadline:
        time.sleep(0.1)


SCENARIOS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "ingest": ingest, "drain": drain, "burst": burst, "replay": replay, "scale": scale, "cost": cost,
    "profile": profile, "steady": steady, "receiver-cost": receiver_cost, "rescue": rescue,
    "retention": retention_scenario,
    "reproject": reproject_scenario,
}
ALL = ("ingest", "drain", "burst", "replay", "scale", "cost", "receiver-cost", "steady")
# Scenarios that take turns between the revisions of --compare themselves (per level);
# every other scenario runs once per revision, the older one first.
INTERLEAVED = ("steady",)
