"""The online partition migration on a large ledger, under live traffic (docs/benchmarks.md, "Moving a
million-event ledger to partitions").

A private PostgreSQL (the bench's settings) gets the schema of the release before partitions (migration
0011), ``--events`` rows written straight by SQL (devkit.benchmarks.retention's ledger: 180 days, 97%
processed, payloads of ~1.5 KB) with their deliveries and attempts, then migration 0012 (columns only: the
ledger keeps its shape). The real receiver (gunicorn, 2 workers) and a real worker (``celery worker -c 2``)
run on it and a private Redis; a sender posts signed ``customer.updated`` events at ``--rate`` a second,
open loop, from ``--before`` seconds before ``ledgerctl partitions migrate`` (the installed command) starts
until ``--after`` seconds after it ended. Printed: the migration's phases and its swap (the only time writers
wait), the receiver's answers by status and ack latency before, during and after, and whether every
acknowledged event is in the ledger once and processed.

    ops/devkit-run devkit.benchmarks.partition_migration [--events 1000000] [--rate 100]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psycopg

from devkit.benchmarks.console_list import busy_share, cpu_times
from devkit.benchmarks.retention import DAYS, FILL, filler
from devkit.benchmarks.stack import bench_postgres
from devkit.factories import customer, event, sign
from devkit.procs import Cleanup
from devkit.servers import PrivateRedis
from devkit.stack import Receiver, Worker, stack_env

SECRET = "whsec_partition_migration_bench"
HISTORY_ROWS = """
INSERT INTO ledger.deliveries (event_id, delivered_at, source) SELECT id, received_at, 'webhook' FROM ledger.events;
INSERT INTO ledger.attempts (event_id, attempt, worker, lease_owner, started_at, finished_at, outcome)
SELECT id, 1, 'bench:0', 'bench:0', updated_at, updated_at, status FROM ledger.events
 WHERE status IN ('failed_permanent', 'processed')
"""


def fill(url: str, total: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        step = 250_000
        items = filler()
        for first in range(1, total + 1, step):
            last = min(total, first + step - 1)
            conn.execute(FILL.replace("%(filler)s", items.replace("%", "%%")),
                         {"first": first, "last": last, "total": total, "span_s": DAYS * 86400})
            print(f"  events {last:,}", flush=True)
        conn.execute(HISTORY_ROWS)
        for table in ("events", "deliveries", "attempts"):
            conn.execute(f"VACUUM (ANALYZE) ledger.{table}")


class Sender(threading.Thread):
    """Open loop: one delivery every 1/rate s (on as many threads as it takes), each answer's status and time."""

    def __init__(self, receiver: Receiver, rate: float):
        super().__init__(daemon=True)
        self.receiver, self.rate = receiver, rate
        self.stop = threading.Event()
        self.phase = "before"
        self.samples: list[tuple[str, int, float]] = []
        self.sent: list[str] = []
        self._lock = threading.Lock()

    def _post(self, n: int, phase: str) -> None:
        now = int(time.time())
        evt = event("customer.updated", customer(created=now, customer_id=f"cus_live_{n % 500}"), created=now)
        body = json.dumps(evt, indent=2)
        started = time.monotonic()
        try:
            status = self.receiver.post(body.encode(), {"Stripe-Signature": sign(body, SECRET)}).status_code
        except OSError:
            status = 0  # the connection failed: counted with the errors
        with self._lock:
            self.samples.append((phase, status, time.monotonic() - started))
            if status == 200:
                self.sent.append(evt["id"])

    def run(self) -> None:
        n, start = 0, time.monotonic()
        while not self.stop.is_set():
            n += 1
            threading.Thread(target=self._post, args=(n, self.phase), daemon=True).start()
            delay = start + n / self.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)


def _latency(samples: list[float]) -> str:
    if not samples:
        return "none"
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (f"p50 {statistics.median(ordered) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
            f"max {ordered[-1] * 1000:.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rate", type=float, default=100.0, help="deliveries a second, sent meanwhile")
    parser.add_argument("--before", type=float, default=20.0)
    parser.add_argument("--after", type=float, default=10.0)
    args = parser.parse_args()
    from ledger.config import Settings
    from ledger.migrate import migrate

    work = Path(tempfile.mkdtemp(prefix="ledger-partition-migration-bench-"))
    cleanup = Cleanup("partition-migration-bench")
    try:
        pg = bench_postgres()
        cleanup.add("private postgres", pg.destroy)
        pg.init().start()
        with psycopg.connect(pg.url_for("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE migration_bench")
        url = pg.url_for("migration_bench")
        migrate(url, upto=11)
        print(f"filling {args.events:,} events over {DAYS} days (the schema before partitions)", flush=True)
        fill(url, args.events)
        migrate(url)
        redis = PrivateRedis(work / "redis.log").start()
        cleanup.add("redis", redis.stop)
        env = stack_env(url, redis.url, {"STRIPE_WEBHOOK_SECRET": SECRET})
        worker = Worker(env, work, queues=(Settings().queue_name,), concurrency=2, node="bench-worker")
        worker.start()
        cleanup.add("worker", worker.stop)
        worker.wait_ready()
        receiver = Receiver(env, work, workers=2, ready_path="/readyz")
        receiver.start()
        cleanup.add("receiver", receiver.stop)

        sender = Sender(receiver, args.rate)
        sender.start()
        time.sleep(args.before)
        sender.phase = "during"
        cpu_before = cpu_times()
        started = time.monotonic()
        run = subprocess.run(["ledgerctl", "partitions", "migrate", "--json"], capture_output=True, text=True,
                             env={**os.environ, "DATABASE_URL": url}, timeout=3600)
        took = time.monotonic() - started
        busy = busy_share(cpu_before, cpu_times())
        sender.phase = "after"
        time.sleep(args.after)
        sender.stop.set()
        time.sleep(2)  # the last answers
        if run.returncode != 0:
            print(run.stderr, flush=True)
            return 1
        report = json.loads(run.stdout)
        by_phase = {phase: [s for s in sender.samples if s[0] == phase] for phase in ("before", "during", "after")}
        with psycopg.connect(url) as conn:
            found = dict(conn.execute("SELECT id, (SELECT count(*) FROM ledger.deliveries d WHERE d.event_id = e.id) "
                                      "FROM ledger.events e WHERE id = ANY(%s)", (sender.sent,)).fetchall())
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and conn.execute(
                    "SELECT count(*) FROM ledger.events WHERE id = ANY(%s) AND status <> 'processed'",
                    (sender.sent,)).fetchone()[0]:
                time.sleep(1)
            unprocessed = conn.execute("SELECT count(*) FROM ledger.events WHERE id = ANY(%s) "
                                       "AND status <> 'processed'", (sender.sent,)).fetchone()[0]
            partitioned = conn.execute("SELECT ledger.is_partitioned()").fetchone()[0]
            total = conn.execute("SELECT count(*) FROM ledger.events").fetchone()[0]
        missing = sum(1 for event_id in sender.sent if found.get(event_id) != 1)
        print(f"\nonline partition migration of {args.events:,} events: {took:.1f} s, machine busy {busy:.0%}")
        print(f"  phases (s): {report['phases']}")
        print(f"  swap (the tables' exclusive lock): {report['swap_s'] * 1000:.0f} ms; lock waits {report['lock_waits']}; "
              f"batches that gave way {report['gave_way']}")
        for phase, samples in by_phase.items():
            statuses = Counter(s[1] for s in samples)
            print(f"  receiver {phase:6}: {len(samples):5} deliveries, answers {dict(statuses)}, "
                  f"{_latency([s[2] for s in samples if s[1] == 200])}")
        errors = sum(1 for s in sender.samples if s[1] != 200)
        print(f"  acknowledged {len(sender.sent):,}: missing or doubled {missing}, not processed {unprocessed}; "
              f"partitioned {partitioned}; events now {total:,}")
        print(f"SUMMARY partition_migration events={args.events} seconds={took:.1f} swap_ms={report['swap_s'] * 1000:.0f} "
              f"non_200={errors} missing={missing} unprocessed={unprocessed} busy={busy:.2f} "
              f"during_p99_ms={_p99(by_phase['during']):.1f} before_p99_ms={_p99(by_phase['before']):.1f}", flush=True)
        return 0 if (errors == 0 and missing == 0 and unprocessed == 0 and partitioned) else 1
    finally:
        cleanup.run()


def _p99(samples) -> float:
    times = sorted(s[2] for s in samples if s[1] == 200)
    return times[min(len(times) - 1, int(len(times) * 0.99))] * 1000 if times else 0.0


if __name__ == "__main__":
    raise SystemExit(main())
