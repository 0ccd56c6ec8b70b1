"""Chaos run: the whole pipeline, real processes, while things keep breaking.

    python -m devkit.chaos --events 5000
    python -m devkit.chaos --broker amqp     # the same run on RabbitMQ

Creates a fresh database ``chaos_<random>`` on the shared server (``--admin-url``,
default ``$TEST_PG_URL`` or postgresql://postgres@127.0.0.1:5432/postgres) and a
broker of the run's own (``--broker``): with ``redis`` (the default) a private
``redis-server`` on a free port; with ``amqp`` a vhost ``chaos-<random>`` on the
machine's RabbitMQ (127.0.0.1:5672, guest/guest, managed with ``rabbitmqctl``:
devkit.servers.RabbitVhost), which is shared, so the run never stops it. It starts
a real receiver (gunicorn), ``--workers`` Celery worker processes and the recovery
sweep (``ledgerctl sweep --loop``), all with ``CELERY_BROKER_URL`` naming that
broker. It then delivers ``--events`` distinct events (subscription lifecycles
from devkit.factories, plus ``chaos.effect`` events whose handler inserts a row into a
table without a unique constraint) over HTTP, signed, from several threads, in a
shuffled order, a fraction of them more than once (some copies at the same moment),
retrying every non-2xx answer or connection error with backoff, as Stripe does.

Meanwhile, every ``--chaos-interval`` seconds, it does one of (each kind once first,
in a random order, then chosen by weight): SIGKILL a worker's prefork child, SIGKILL
a whole worker (and start a new one), flush the broker, restart the broker,
pg_terminate_backend the workers' connections (application_name 'worker', in the
chaos database only), SIGKILL and restart the receiver. The broker's two faults:

* ``flush_broker``: with Redis, FLUSHALL (the queued messages, Redis' copies of the
  unacked ones and kombu's bindings all gone; clients stay connected). With
  RabbitMQ, ``queue.purge`` of the stack's two queues (the event queue and its
  effects queue: every queue of the vhost but the workers' exclusive
  remote-control mailboxes, which only their own connection may touch): the
  waiting messages are gone and clients stay connected. On either, the messages a
  worker already holds stay with it and run; they differ only should that worker
  die later: Redis' copies are gone, RabbitMQ redelivers them.
* ``restart_broker``: with Redis, SIGKILL the server and start it again, empty, on
  the same port after an outage of 0.2-2 s. With RabbitMQ (shared: never
  stopped), a server restart as the vhost sees it: new connections refused
  (``set_vhost_limits`` max-connections 0), every connection of the vhost closed
  (``close_all_connections -p``), and connections accepted again 0.2-2 s after
  the limit was set (at the soonest once they are all closed, and then once
  ``clear_vhost_limits`` is through: a few seconds more on a busy machine, where
  rabbitmqctl is slow). Like a real restart, the durable queues keep their
  persistent messages, and the unacked ones go back to their queue to be
  redelivered.

Deleting and re-creating the vhost is neither: it also closes every connection and
refuses reconnections until the vhost is back, a restart that comes back empty
rather than a flush.

The workers themselves inject recoverable faults into a fraction (``--fault-rate``)
of attempts, after the domain writes and in the same transaction
(devkit/chaos_handlers.py: TransientError, a real lock timeout, a real statement
timeout), chosen by a hash of the event id and attempt number.

When every delivery is accepted, the chaos stops and the run waits until the
ledger is quiescent (the sweep re-drives whatever lost its wake-up). Then it
checks: every event recorded and processed (or failed_permanent with a reason);
exactly one ``chaos.effect`` row per effect event and one subscription transition
per subscription event; no row left received / processing / failed_recoverable;
and billing rows equal to those obtained by applying the same events in created
order, in-process, to a second fresh database (``chaos_<random>_ref``); and no
attempt into which a fault was injected committed.

It prints one summary line on stdout (``--json-out FILE`` also writes the result
as JSON; both name the broker), exits 0 if everything held and 1 otherwise, and
drops both databases and the vhost (``--keep`` keeps the databases and the logs).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psycopg

from devkit.servers import PrivateRedis, RabbitVhost, with_db
from devkit.sql import SQL, compose
from devkit.stack import Receiver, Sweep, Worker, stack_env

HANDLERS = "devkit.chaos_handlers"
SECRET = "whsec_chaos_0123456789abcdef"
QUEUE = "chaos"
ADMIN_URL = os.environ.get("TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
UNFINISHED = ("received", "processing", "failed_recoverable")
BROKERS = ("redis", "amqp")  # --broker: RedisBroker, RabbitBroker
DOMAIN_FAULT_CLASSES = ("TransientError", "LockNotAvailable", "QueryCanceled")

# Billing rows compared with the in-order run (devkit/sql/chaos.sql: the columns that say what a row is).
SNAPSHOT = {name: getattr(SQL, f"chaos_snapshot_{name}")
            for name in ("customers", "subscriptions", "invoices", "checkout_sessions", "entitlements")}


@dataclass
class Config:
    events: int = 300
    duplicate_rate: float = 0.3
    fault_rate: float = 0.15
    workers: int = 2
    concurrency: int = 2
    senders: int = 8
    chaos_interval: tuple[float, float] = (0.3, 1.5)
    min_chaos_s: float = 20.0
    quiesce_timeout_s: float | None = None
    admin_url: str = ADMIN_URL
    seed: int | None = None
    keep: bool = False
    logs_dir: str | None = None  # default: a new temporary directory, removed after a clean run
    verbose: bool = True
    broker: str = "redis"  # one of BROKERS


@dataclass
class Result:
    events: int = 0
    deliveries: int = 0          # rows in ledger.deliveries: every delivery the receiver recorded
    http_attempts: int = 0       # every POST, including refused / failed ones
    non_2xx: dict = field(default_factory=dict)
    faults_injected: int = 0
    faults: dict = field(default_factory=dict)
    lost: int = 0                # events delivered (2xx) but without a ledger row, or never accepted
    duplicated_effects: int = 0  # effect rows beyond one per event
    missing_effects: int = 0     # processed events without their effect
    phantom_effects: int = 0     # effects of events that are not processed
    faults_swallowed: int = 0    # attempts with an injected fault that committed anyway
    stuck: int = 0               # rows left received / processing / failed_recoverable
    processing: int = 0
    failed: int = 0              # failed_permanent
    failed_without_reason: int = 0
    billing_mismatches: int = 0
    attempts: dict = field(default_factory=dict)
    fault_errors: list = field(default_factory=list)  # faults that could not be injected, and why
    elapsed_s: float = 0.0
    seed: int = 0
    broker: str = "redis"

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated_effects or self.missing_effects or self.phantom_effects
                    or self.faults_swallowed or self.stuck or self.failed or self.failed_without_reason
                    or self.billing_mismatches)

    def line(self) -> str:
        faults = " ".join(f"{k}={v}" for k, v in sorted(self.faults.items()))
        return (f"chaos: events={self.events} deliveries={self.deliveries} http_attempts={self.http_attempts} "
                f"faults_injected={self.faults_injected} ({faults}) lost={self.lost} "
                f"duplicated_effects={self.duplicated_effects} missing_effects={self.missing_effects} "
                f"faults_swallowed={self.faults_swallowed} "
                f"stuck={self.stuck} failed={self.failed} billing_mismatches={self.billing_mismatches} "
                f"elapsed={self.elapsed_s:.0f}s seed={self.seed} broker={self.broker} {'OK' if self.ok else 'FAILED'}")


def log(cfg: Config, message: str) -> None:
    if cfg.verbose:
        print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- events -------------------------------------------------------------------------------

def build_events(n: int, rng: random.Random) -> list[dict]:
    """n distinct events: about two thirds subscription lifecycles, the rest chaos.effect events."""
    from devkit.factories import BASIL_API, OLD_API, SubscriptionHistory, event

    events: list[dict] = []
    target = n * 2 // 3
    while len(events) < target:
        history = SubscriptionHistory(api_version=rng.choice([OLD_API, BASIL_API]),
                                      start=1_700_000_000 + rng.randrange(1_000_000)).lifecycle()
        events.extend(history.events[: target - len(events)])
    k = 0
    while len(events) < n:
        events.append(event("chaos.effect", {"id": f"chaos_{k}", "object": "chaos"},
                            created=1_700_000_000 + rng.randrange(1_000_000)))
        k += 1
    return events


def delivery_plan(events: list[dict], rng: random.Random, duplicate_rate: float) -> list[int]:
    """Indices into events, one per delivery: shuffled, a fraction of the events two or three times,
    half of those with two copies side by side (two senders pick them up at the same moment)."""
    units: list[list[int]] = []
    for i in range(len(events)):
        copies = 1
        if rng.random() < duplicate_rate:
            copies += 1 + (rng.random() < 0.3)
        if copies >= 2 and rng.random() < 0.5:
            units.append([i, i])
            copies -= 2
        units.extend([i] for _ in range(copies))
    rng.shuffle(units)
    return [i for unit in units for i in unit]


# -- brokers ------------------------------------------------------------------------------
# The same four moves on either broker, so that the faults are broker-neutral. The broker's URL
# stays the same across flushes and restarts: the stack's CELERY_BROKER_URL stays valid.

class RedisBroker:
    """A private redis-server on a free port (devkit.servers.PrivateRedis)."""

    name = "redis"

    def __init__(self, workdir: Path, tag: str):
        self.server = PrivateRedis(workdir / "redis.log", databases=2)

    @property
    def url(self) -> str:
        return self.server.url

    def describe(self) -> str:
        return f"redis :{self.server.port}"

    def start(self) -> None:
        self.server.start()

    def flush(self) -> None:
        """FLUSHALL."""
        self.server.flush()

    def restart(self, outage_s: float) -> None:
        """SIGKILL, down for outage_s, then up again, empty, on the same port."""
        self.server.kill()
        time.sleep(outage_s)
        self.server.start()

    def stop(self) -> None:
        self.server.kill()


class RabbitBroker:
    """A vhost of the run's own on the machine's RabbitMQ (devkit.servers.RabbitVhost).

    The server is shared: nothing here stops it, or touches another vhost.
    """

    name = "amqp"

    def __init__(self, workdir: Path, tag: str):
        from workers.app import effects_queue

        self.vhost = RabbitVhost(f"chaos-{tag}")
        self.queues = (QUEUE, effects_queue(QUEUE))  # the stack's (LEDGER_QUEUE=QUEUE)

    @property
    def url(self) -> str:
        return self.vhost.url

    def describe(self) -> str:
        return f"rabbitmq vhost {self.vhost.name} on {self.vhost.host}:{self.vhost.port}"

    def start(self) -> None:
        self.vhost.create()

    def flush(self) -> None:
        """The stack's queues (QUEUE and its effects queue: every queue of the vhost but the workers'
        exclusive remote-control mailboxes, which only their own connection may touch) lose the
        messages waiting in them; connections, consumers and the messages workers hold unacked stay
        (see the module's docstring). Done over AMQP, without rabbitmqctl (slow on a busy machine)."""
        self.vhost.purge(self.queues)

    def restart(self, outage_s: float) -> None:
        """A server restart as seen from the vhost: every connection closed, new ones refused for
        outage_s (or as long as closing them takes, and then while rabbitmqctl lifts the limit: each
        call takes a second or more, several on a busy machine), then accepted again; the queues keep
        their messages, and the unacked ones go back to their queue."""
        self.vhost.ctl("set_vhost_limits", "-p", self.vhost.name, json.dumps({"max-connections": 0}))
        refused_since = time.monotonic()
        try:
            self.vhost.ctl("close_all_connections", "-p", self.vhost.name, "chaos: broker restart")
            time.sleep(max(0.0, refused_since + outage_s - time.monotonic()))
        finally:
            self.vhost.ctl("clear_vhost_limits", "-p", self.vhost.name)

    def stop(self) -> None:
        self.vhost.drop()


BROKER_CLASSES = {cls.name: cls for cls in (RedisBroker, RabbitBroker)}


# -- processes ----------------------------------------------------------------------------

class Stack:
    """The run's broker, receiver, workers and sweep (devkit.servers / devkit.stack).

    The broker and the receiver keep their URL and port across restarts: the workers'
    broker URL and the senders' target stay valid.
    """

    def __init__(self, cfg: Config, database_url: str, workdir: Path, tag: str):
        self.cfg = cfg
        self.database_url = database_url
        self.workdir = workdir
        self.broker = BROKER_CLASSES[cfg.broker](workdir, tag)
        # The variables the pipeline reads are ours alone.
        self.env = stack_env(database_url, self.broker.url, {
            "STRIPE_WEBHOOK_SECRET": SECRET, "LEDGER_QUEUE": QUEUE, "LEDGER_HANDLER_MODULES": HANDLERS,
            "LEDGER_LEASE_S": "6", "LEDGER_MAX_ATTEMPTS": "30", "LEDGER_RETRY_BASE_S": "0.1",
            "LEDGER_RETRY_CAP_S": "2", "LEDGER_SWEEP_OVERDUE_S": "2", "LEDGER_SWEEP_INTERVAL_S": "1",
            "LEDGER_SWEEP_BATCH": "500", "LOG_LEVEL": "WARNING", "CHAOS_FAULT_RATE": str(cfg.fault_rate),
        })
        self.receiver = Receiver(self.env, workdir, workers=2)
        self.sweep: Sweep | None = None
        self.workers: list[Worker] = []
        self._n = 0

    @property
    def receiver_port(self) -> int:
        return self.receiver.port

    def restart_receiver(self) -> None:
        self.receiver.kill()
        self.receiver.start()

    def start_worker(self) -> Worker:
        self._n += 1
        worker = Worker(self.env, self.workdir, queues=(QUEUE,), concurrency=self.cfg.concurrency,
                        node=f"chaos{self._n}-{uuid.uuid4().hex[:6]}").start()
        self.workers.append(worker)
        return worker

    def live_workers(self) -> list[Worker]:
        self.workers = [w for w in self.workers if w.alive]
        return self.workers

    def top_up_workers(self) -> int:
        started = 0
        while len(self.live_workers()) < self.cfg.workers:
            self.start_worker()
            started += 1
        return started

    def start_sweep(self) -> None:
        self.sweep = Sweep(self.env, self.workdir).start()

    def close(self) -> None:
        for proc in [*self.workers, self.sweep, self.receiver]:
            if proc is not None:
                proc.kill()
        try:
            self.broker.stop()
        except Exception as exc:  # reported; the run still drops its databases
            log(self.cfg, f"could not stop the broker ({self.broker.describe()}): {exc}")


# -- delivering -----------------------------------------------------------------------------

class Sender:
    """Delivers bodies like Stripe: signed, retried with backoff on any non-2xx or connection error."""

    def __init__(self, stack: Stack, give_up_after_s: float):
        self.stack = stack
        self.give_up_after_s = give_up_after_s
        self.lock = threading.Lock()
        self.http_attempts = 0
        self.accepted = 0
        self.non_2xx: Counter = Counter()
        self.undelivered: list[str] = []

    def deliver(self, event_id: str, body: str) -> None:
        from devkit.factories import sign

        data = body.encode()
        delay = 0.1
        started = time.monotonic()
        while True:
            status: int | str
            try:
                headers = {"Content-Type": "application/json", "Stripe-Signature": sign(body, SECRET, int(time.time()))}
                request = urllib.request.Request(f"http://127.0.0.1:{self.stack.receiver_port}/webhooks/stripe",
                                                 data=data, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=30) as response:
                    status = response.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            except OSError as exc:
                status = type(exc).__name__
            with self.lock:
                self.http_attempts += 1
                if isinstance(status, int) and 200 <= status < 300:
                    self.accepted += 1
                    return
                self.non_2xx[str(status)] += 1
            if time.monotonic() - started > self.give_up_after_s:
                with self.lock:
                    self.undelivered.append(event_id)
                return
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, 5.0)


# -- faults ---------------------------------------------------------------------------------

class Chaos(threading.Thread):
    ACTIONS = (("kill_worker_child", 4), ("kill_worker", 2), ("flush_broker", 1), ("restart_broker", 1),
               ("terminate_pg_backends", 3), ("restart_receiver", 1))

    def __init__(self, cfg: Config, stack: Stack, rng: random.Random):
        super().__init__(daemon=True, name="chaos")
        self.cfg, self.stack, self.rng = cfg, stack, rng
        self.stop = threading.Event()
        self.counts: Counter = Counter()
        self.errors: list[str] = []
        self.every_kind_tried = threading.Event()  # set once each kind of fault had its first turn

    def run(self) -> None:
        names = [a for a, _ in self.ACTIONS]
        weights = [w for _, w in self.ACTIONS]
        # Every kind once first, in a random order (so that every run has each), then by weight.
        first = self.rng.sample(names, len(names))
        while not self.stop.wait(self.rng.uniform(*self.cfg.chaos_interval)):
            action = first.pop() if first else self.rng.choices(names, weights)[0]
            if not first:
                self.every_kind_tried.set()
            try:
                if getattr(self, action)():
                    self.counts[action] += 1
            except Exception as exc:  # a fault that failed to happen is reported, not fatal
                self.errors.append(f"{action}: {type(exc).__name__}: {exc}")
            self.stack.top_up_workers()

    def kill_worker_child(self) -> bool:
        children = [(w, pid) for w in self.stack.live_workers() for pid in w.children()]
        if not children:
            return False
        _, pid = self.rng.choice(children)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def kill_worker(self) -> bool:
        live = self.stack.live_workers()
        if not live:
            return False
        self.rng.choice(live).kill()
        self.stack.top_up_workers()
        return True

    def flush_broker(self) -> bool:
        self.stack.broker.flush()
        return True

    def restart_broker(self) -> bool:
        self.stack.broker.restart(outage_s=self.rng.uniform(0.2, 2.0))
        return True

    def terminate_pg_backends(self) -> bool:
        with psycopg.connect(self.stack.database_url, autocommit=True, application_name="chaos-harness") as conn:
            n = conn.execute(SQL.chaos_terminate_worker_backends).fetchone()[0]
        return n > 0

    def restart_receiver(self) -> bool:
        self.stack.restart_receiver()
        return True


# -- checking -----------------------------------------------------------------------------

def ledger_counts(url: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return dict(conn.execute(SQL.chaos_events_by_status).fetchall())


def reference_snapshot(events: list[dict], url: str) -> dict[str, set]:
    """Apply every event once, in created order, in-process, on a fresh database; its billing rows."""
    from ledger.config import Settings
    from ledger.db import ProcessPool
    from ledger.deliveries import EventStore
    from ledger.attempts import WorkerLedger
    from devkit.factories import incoming
    from workers.processor import EventProcessor, Outcome
    from workers.registry import load_handlers

    os.environ.pop("CHAOS_FAULT_RATE", None)  # no faults here
    settings = Settings(database_url=url, broker_url="memory://", handler_modules=(HANDLERS,), lease_s=60)
    pool = ProcessPool(settings, name="chaos-reference")
    try:
        store = EventStore(pool)
        processor = EventProcessor.from_settings(settings, WorkerLedger(pool), load_handlers(settings), None)
        for evt in sorted(events, key=lambda e: (e["created"], e["id"])):
            store.record_delivery(incoming(evt))
            outcome = processor.process(evt["id"])
            if outcome is not Outcome.PROCESSED:
                raise RuntimeError(f"reference run: {evt['id']} ({evt['type']}) ended {outcome}")
    finally:
        pool.close()
    return billing_snapshot(url)


def billing_snapshot(url: str) -> dict[str, set]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {name: {tuple(map(str, row)) for row in conn.execute(sql).fetchall()} for name, sql in SNAPSHOT.items()}


def check(events: list[dict], url: str, reference: dict[str, set], result: Result, fault_rate: float) -> list[str]:
    """Fill the result's counters; return human-readable details of every problem."""
    from devkit.chaos_handlers import fault_for

    problems: list[str] = []
    ids = [e["id"] for e in events]
    effect_ids = {e["id"] for e in events if e["type"] == "chaos.effect"}
    subscription_ids = {e["id"] for e in events if e["type"].startswith("customer.subscription.")}
    with psycopg.connect(url, autocommit=True) as conn:
        rows = {r[0]: r[1:] for r in conn.execute(SQL.chaos_events_sent, {"ids": ids}).fetchall()}
        extra = conn.execute(SQL.chaos_events_count_not_sent, {"ids": ids}).fetchone()[0]
        effects = dict(conn.execute(SQL.chaos_effects_by_event).fetchall())
        transitions = dict(conn.execute(SQL.chaos_transitions_by_event).fetchall())
        result.deliveries = conn.execute(SQL.chaos_deliveries_count).fetchone()[0]
        result.attempts = dict(conn.execute(SQL.chaos_attempts_by_outcome).fetchall())
        domain = dict(conn.execute(SQL.chaos_attempts_by_error_class,
                                   {"classes": list(DOMAIN_FAULT_CLASSES)}).fetchall())
        committed = conn.execute(SQL.chaos_attempts_processed).fetchall()
    result.faults.update({f"domain_{k}": v for k, v in domain.items()})
    # The workers fail exactly the attempts fault_for() picks: none of those may have committed.
    swallowed = [(e, a) for e, a in committed if fault_rate and fault_for(e, a, fault_rate)]
    result.faults_swallowed = len(swallowed)
    if swallowed:
        problems.append(f"attempts with an injected fault that committed as processed: {swallowed[:10]}")
    if extra:
        problems.append(f"{extra} ledger rows for ids that were never sent")
    missing_rows = [i for i in ids if i not in rows]
    result.lost = len(missing_rows)
    if missing_rows:
        problems.append(f"lost (no ledger row): {missing_rows[:10]}")
    statuses = Counter(status for status, _ in rows.values())
    result.stuck = sum(statuses[s] for s in UNFINISHED)
    result.processing = statuses["processing"]
    result.failed = statuses["failed_permanent"]
    result.failed_without_reason = sum(1 for s, r in rows.values() if s.startswith("failed_") and not r)
    if result.stuck:
        problems.append("stuck: " + ", ".join([f"{i} {rows[i][0]}" for i in ids
                                               if i in rows and rows[i][0] in UNFINISHED][:10]))
    if result.failed:
        problems.append("failed_permanent: " + ", ".join([f"{i} {r}" for i, (s, r) in rows.items()
                                                          if s == "failed_permanent"][:10]))
    for name, counted, expected_ids in (("chaos_effects", effects, effect_ids),
                                        ("subscription_transitions", transitions, subscription_ids)):
        processed = {i for i in expected_ids if rows.get(i, ("",))[0] == "processed"}
        dup = {i: n for i, n in counted.items() if n > 1}
        result.duplicated_effects += sum(n - 1 for n in dup.values())
        missing = processed - set(counted)
        phantom = set(counted) - processed
        result.missing_effects += len(missing)
        result.phantom_effects += len(phantom)
        if dup:
            problems.append(f"{name}: applied more than once: {list(dup.items())[:10]}")
        if missing:
            problems.append(f"{name}: processed without its effect: {sorted(missing)[:10]}")
        if phantom:
            problems.append(f"{name}: effect of an event that is not processed: {sorted(phantom)[:10]}")
    actual = billing_snapshot(url)
    for name in SNAPSHOT:
        differ = actual[name] ^ reference[name]
        if differ:
            result.billing_mismatches += len(differ)
            only_chaos = sorted(actual[name] - reference[name])[:3]
            only_ref = sorted(reference[name] - actual[name])[:3]
            problems.append(f"billing.{name}: {len(differ)} rows differ from the in-order run; "
                            f"chaos run only: {only_chaos}; in-order only: {only_ref}")
    return problems


# -- the run ----------------------------------------------------------------------------------

def create_database(admin_url: str, name: str) -> str:
    from ledger.migrate import migrate
    from devkit.chaos_handlers import TABLES_DDL

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(compose(SQL.database_create, database=name))
    url = with_db(admin_url, name)
    migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        for ddl in TABLES_DDL:
            conn.execute(ddl)
    return url


def drop_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(compose(SQL.database_drop, database=name))


def run(cfg: Config) -> tuple[Result, list[str]]:
    from devkit.factories import body_of

    started = time.monotonic()
    seed = cfg.seed if cfg.seed is not None else random.randrange(2 ** 32)
    rng = random.Random(seed)
    result = Result(events=cfg.events, seed=seed, broker=cfg.broker)
    tag = uuid.uuid4().hex[:10]
    name, ref_name = f"chaos_{tag}", f"chaos_{tag}_ref"
    if cfg.logs_dir:
        workdir = Path(cfg.logs_dir)
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix=f"chaos-{tag}-"))
    quiesce_timeout_s = cfg.quiesce_timeout_s or 600 + 0.5 * cfg.events
    problems: list[str] = []
    stack: Stack | None = None
    chaos: Chaos | None = None
    lock_holder = None
    created: list[str] = []
    try:
        url = create_database(cfg.admin_url, name)
        created.append(name)
        ref_url = create_database(cfg.admin_url, ref_name)
        created.append(ref_name)
        log(cfg, f"databases {name}, {ref_name}; logs in {workdir}; seed {seed}")
        # Held for the whole run: the lock-timeout fault waits on this row.
        lock_holder = psycopg.connect(url, application_name="chaos-harness")
        lock_holder.execute(SQL.chaos_lock_row)

        events = build_events(cfg.events, rng)
        plan = delivery_plan(events, rng, cfg.duplicate_rate)
        bodies = [body_of(e) for e in events]

        stack = Stack(cfg, url, workdir, tag)
        stack.broker.start()
        stack.receiver.start()
        for _ in range(cfg.workers):
            stack.start_worker()
        for worker in list(stack.workers):
            worker.wait_ready(timeout_s=120)
        stack.start_sweep()
        log(cfg, f"stack up: {stack.broker.describe()}, receiver :{stack.receiver.port}, "
                 f"{cfg.workers} workers x {cfg.concurrency}; delivering {len(plan)} deliveries of {len(events)} events")

        chaos = Chaos(cfg, stack, random.Random(rng.random()))
        chaos.start()
        chaos_started = time.monotonic()
        sender = Sender(stack, give_up_after_s=quiesce_timeout_s)
        work: queue.Queue = queue.Queue()
        for k, i in enumerate(plan):
            work.put((k, i))
        # Deliveries are spread over at least most of the chaos period, so faults hit them too.
        pace_s = 0.8 * cfg.min_chaos_s / len(plan)
        t0 = time.monotonic()

        def send_all():
            while True:
                try:
                    k, i = work.get_nowait()
                except queue.Empty:
                    return
                wait = t0 + k * pace_s - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                sender.deliver(events[i]["id"], bodies[i])

        senders = [threading.Thread(target=send_all, daemon=True) for _ in range(cfg.senders)]
        for t in senders:
            t.start()
        while any(t.is_alive() for t in senders):
            for t in senders:
                t.join(10)
            counts = ledger_counts(url)
            log(cfg, f"delivered {sender.accepted}/{len(plan)} (http {sender.http_attempts}); ledger {counts}; "
                     f"faults {dict(chaos.counts)}")
        remaining = cfg.min_chaos_s - (time.monotonic() - chaos_started)
        if remaining > 0:
            time.sleep(remaining)
        # On a loaded machine a RabbitMQ fault (rabbitmqctl) takes seconds: the chaos goes on until every
        # kind had its turn, so that each run has each.
        chaos.every_kind_tried.wait(120)
        chaos.stop.set()
        chaos.join(120)
        stack.top_up_workers()
        if not stack.sweep.alive:
            stack.start_sweep()
        log(cfg, f"chaos stopped after {time.monotonic() - chaos_started:.0f}s: {dict(chaos.counts)}; waiting for quiescence")

        deadline = time.monotonic() + quiesce_timeout_s
        last_report = 0.0
        while True:
            counts = ledger_counts(url)
            if sum(counts.values()) >= len(events) and not any(counts.get(s) for s in UNFINISHED):
                break
            if time.monotonic() > deadline:
                problems.append(f"not quiescent after {quiesce_timeout_s:.0f}s: {counts}")
                break
            stack.top_up_workers()
            if not stack.sweep.alive:
                stack.start_sweep()
            if time.monotonic() - last_report > 10:
                log(cfg, f"ledger {counts}")
                last_report = time.monotonic()
            time.sleep(0.5)
        log(cfg, f"quiescent: {ledger_counts(url)}; applying the same events in order on {ref_name}")

        result.http_attempts = sender.http_attempts
        result.non_2xx = dict(sender.non_2xx)
        result.faults = dict(chaos.counts)
        result.fault_errors = list(chaos.errors)
        if sender.undelivered:
            problems.append(f"never accepted by the receiver: {sender.undelivered[:10]}")
        if chaos.errors:
            log(cfg, f"faults that could not be injected: {chaos.errors[:5]}")
        reference = reference_snapshot(events, ref_url)
        problems += check(events, url, reference, result, cfg.fault_rate)
        result.lost += len(sender.undelivered)
        result.faults_injected = sum(result.faults.values())
    finally:
        if chaos is not None:
            chaos.stop.set()
            chaos.join(60)
        if stack is not None:
            stack.close()
        if lock_holder is not None:
            lock_holder.close()
        result.elapsed_s = time.monotonic() - started
        failed = bool(problems) or not result.ok
        if not cfg.keep:
            for db in created:
                try:
                    drop_database(cfg.admin_url, db)
                except Exception as exc:  # reported, the run's result stands
                    log(cfg, f"could not drop {db}: {exc}")
            if not failed and not cfg.logs_dir:
                shutil.rmtree(workdir, ignore_errors=True)
        if failed or cfg.keep or cfg.logs_dir:
            log(cfg, f"logs in {workdir}")
    return result, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devkit.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=300, help="distinct events to deliver (default 300)")
    parser.add_argument("--broker", choices=BROKERS, default="redis",
                        help="redis: a private redis-server (default); amqp: a vhost of the run's own on the "
                             "RabbitMQ at 127.0.0.1:5672 (guest/guest, rabbitmqctl on PATH)")
    parser.add_argument("--duplicates", type=float, default=0.3, help="fraction of events delivered more than once")
    parser.add_argument("--fault-rate", type=float, default=0.15, help="fraction of attempts failed on purpose")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork children per worker (default 2)")
    parser.add_argument("--senders", type=int, default=8, help="concurrent HTTP senders (default 8)")
    parser.add_argument("--chaos-interval", type=float, nargs=2, default=(0.3, 1.5), metavar=("MIN", "MAX"),
                        help="seconds between faults (uniform)")
    parser.add_argument("--min-chaos-s", type=float, default=20.0,
                        help="keep breaking things at least this long; deliveries are spread over most of it")
    parser.add_argument("--quiesce-timeout-s", type=float, default=None)
    parser.add_argument("--admin-url", default=ADMIN_URL, help="a database URL on the server to create databases on")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the databases and logs")
    parser.add_argument("--logs-dir", help="write the processes' logs here (kept); default: a temporary "
                                           "directory, removed unless the run fails")
    parser.add_argument("--json-out", help="also write the result as JSON to this file")
    parser.add_argument("--quiet", action="store_true", help="only the summary line")
    args = parser.parse_args(argv)
    if args.events < 1 or args.workers < 1:
        parser.error("--events and --workers must be at least 1")
    if args.broker == "amqp" and not RabbitVhost.available():
        parser.error("--broker amqp: no RabbitMQ answers on 127.0.0.1:5672, or rabbitmqctl cannot manage it")
    cfg = Config(events=args.events, duplicate_rate=args.duplicates, fault_rate=args.fault_rate,
                 workers=args.workers, concurrency=args.concurrency, senders=args.senders,
                 chaos_interval=tuple(args.chaos_interval), min_chaos_s=args.min_chaos_s,
                 quiesce_timeout_s=args.quiesce_timeout_s, admin_url=args.admin_url, seed=args.seed,
                 keep=args.keep, logs_dir=args.logs_dir, verbose=not args.quiet, broker=args.broker)
    def stop(signum, _frame):  # so that `finally` stops every process we started and drops the databases
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    result, problems = run(cfg)
    for problem in problems:
        print(f"[chaos] PROBLEM: {problem}", file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**asdict(result), "ok": result.ok and not problems,
                                                   "problems": problems, "summary": result.line()}, indent=2))
    print(result.line(), flush=True)
    return 0 if result.ok and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
