"""Retention on a large ledger: how fast a run archives and removes, and how long its removals hold locks
(docs/benchmarks.md, "Retention").

A private PostgreSQL (the bench's settings) gets the ledger's schema and ``--events`` rows written straight
by SQL, received evenly over the last 180 days: 97% processed, 1% failed_permanent, the rest unfinished
(received, failed_recoverable, processing), each with a delivery and, for failures, an attempt; payloads
of about 1.5 KB, pretty-printed as Stripe sends them. Then one retention run (processed kept 90 days,
failed_permanent 120) into an archive directory, or with ``--s3`` a bucket of a moto server process, over
HTTP. Printed: events archived per second (reading, compressing, writing and reading back the files),
removed per second, the longest removal transaction, the archive's size, the machine's busy share.

``--writers RATE``: meanwhile, new events are recorded at RATE a second through the receiver's own
statement (ledger.deliveries.EventStore.record_delivery, on a pool of its own), from 20 s before the run
to its end; printed: that statement's latency (p50, p99, max) before the run and during it, the stage
a receiver's acknowledgement waits on (a diagnostic, not the receiver's ack time).

    ops/devkit-run devkit.benchmarks.retention [--events 3000000] [--s3] [--partitioned] [--writers 100]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import psycopg

from devkit.benchmarks.console_list import busy_share, cpu_times
from devkit.benchmarks.stack import migrated_database, partition_months
from devkit.procs import Cleanup

TARGET_ARCHIVE_EPS = 20_000
DAYS = 180

FILL = """
INSERT INTO ledger.events (id, type, status, attempts, failure_reason, last_error, stripe_created, livemode,
                           api_version, payload, received_at, wakeup_at, next_attempt_at, lease_owner,
                           lease_expires_at, processed_at, updated_at)
SELECT 'evt_' || left(md5(n::text), 24), 'customer.subscription.updated',
       s.status, CASE WHEN s.status = 'received' THEN 0 ELSE 1 END,
       CASE WHEN s.status LIKE 'failed%%' THEN 'unmappable_payload' END,
       CASE WHEN s.status LIKE 'failed%%' THEN 'a failure, as a handler words it' END,
       at - interval '2 seconds', false, '2024-06-20',
       ('{\n  "id": "evt_' || left(md5(n::text), 24) || E'",\n  "object": "event",\n  "api_version": "2024-06-20",\n'
        || '  "created": ' || extract(epoch FROM at)::bigint || E',\n  "data": {\n    "object": {\n'
        || '      "id": "sub_' || n || E'",\n      "object": "subscription",\n      "customer": "cus_' || (n %% 50000)
        || E'",\n      "status": "active",\n      "items": ' || %(filler)s || E'\n    }\n  },\n'
        || E'  "livemode": false,\n  "type": "customer.subscription.updated"\n}')::json,
       at, at, CASE WHEN s.status = 'failed_recoverable' THEN now() + interval '1 hour' END,
       CASE WHEN s.status = 'processing' THEN 'bench:0' END,
       CASE WHEN s.status = 'processing' THEN now() + interval '1 hour' END,
       CASE WHEN s.status = 'processed' THEN at + interval '1 second' END, at
  FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS n,
       LATERAL (SELECT now() - make_interval(secs => ((%(total)s::bigint - n) * %(span_s)s::float8 / %(total)s::bigint))
                AS at) t,
       LATERAL (SELECT CASE WHEN n %% 100 = 0 THEN 'failed_permanent' WHEN n %% 200 = 1 THEN 'failed_recoverable'
                            WHEN n %% 200 = 3 THEN 'received' WHEN n %% 200 = 5 THEN 'processing'
                            ELSE 'processed' END AS status) s
"""
DELIVERIES = """
INSERT INTO ledger.deliveries (event_id, event_created, delivered_at, source) SELECT id, stripe_created, received_at, 'webhook' FROM ledger.events
"""
ATTEMPTS = """
INSERT INTO ledger.attempts (event_id, event_created, attempt, worker, lease_owner, started_at, finished_at, outcome, error_class)
SELECT id, stripe_created, 1, 'bench:0', 'bench:0', updated_at, updated_at, status, 'BenchError'
  FROM ledger.events WHERE status IN ('failed_permanent', 'failed_recoverable', 'processed')
"""


def filler() -> str:
    """A subscription's items, as Stripe pretty-prints them: what makes a payload ~1.5 KB."""
    item = ('{\n        "id": "si_bench",\n        "object": "subscription_item",\n        "price": {\n'
            '          "id": "price_bench",\n          "object": "price",\n          "currency": "usd",\n'
            '          "unit_amount": 2000,\n          "recurring": {"interval": "month", "interval_count": 1}\n'
            '        },\n        "quantity": 1\n      }')
    return "'" + ('{\n        "object": "list",\n        "data": [' + ", ".join([item] * 3) + ']\n      }') + "'"


def fill(url: str, total: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        partition_months(conn, DAYS)
        step = 250_000
        items = filler()
        for first in range(1, total + 1, step):
            last = min(total, first + step - 1)
            started = time.monotonic()
            conn.execute(FILL.replace("%(filler)s", items.replace("%", "%%")),
                         {"first": first, "last": last, "total": total, "span_s": DAYS * 86400})
            print(f"  events {last:,} ({time.monotonic() - started:.1f} s)", flush=True)
        conn.execute(DELIVERIES)
        conn.execute(ATTEMPTS)
        for table in ("events", "deliveries", "attempts"):
            conn.execute(f"VACUUM (ANALYZE) ledger.{table}")


class Writers:
    """New events recorded at a fixed rate by the receiver's statement, each one's latency kept by phase."""

    def __init__(self, url: str, rate: float):
        import threading

        from ledger.config import Settings
        from ledger.db import ProcessPool
        from ledger.deliveries import EventStore

        self._pool = ProcessPool(Settings(database_url=url), name="retention-bench-writers")
        self._store = EventStore(self._pool)
        self._rate = rate
        self.phase = "before"
        self.latencies: dict[str, list[float]] = {"before": [], "during": []}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="writers", daemon=True)

    def _run(self) -> None:
        from devkit.factories import event, incoming

        n, started = 0, time.monotonic()
        while not self._stop.is_set():
            n += 1
            wait = started + n / self._rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            evt = event("customer.subscription.updated", {"id": f"sub_w{n}", "object": "subscription"},
                        created=int(time.time()), event_id=f"evt_writer{n:010d}")
            t0 = time.monotonic()
            try:
                self._store.record_delivery(incoming(evt))
            except Exception:  # counted: the run's report says how many
                self.errors += 1
                continue
            self.latencies[self.phase].append((time.monotonic() - t0) * 1000)

    def start(self) -> "Writers":
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._pool.close()

    def summary(self) -> str:
        def q(values: list[float], share: float) -> float:
            return sorted(values)[min(len(values) - 1, int(share * len(values)))] if values else 0.0
        return "; ".join(f"{phase} ({len(v)}): p50 {q(v, 0.5):.1f} ms, p99 {q(v, 0.99):.1f} ms, max {max(v or [0]):.1f} ms"
                         for phase, v in self.latencies.items()) + f"; errors {self.errors}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=3_000_000)
    parser.add_argument("--s3", action="store_true", help="archive into a bucket of a moto server process")
    parser.add_argument("--partitioned", action="store_true", help="partition the ledger first (by month)")
    parser.add_argument("--writers", type=float, default=0.0, help="new events a second recorded meanwhile "
                        "through the receiver's statement (0: none)")
    parser.add_argument("--readers", type=int, default=None, help="connections reading slices at once "
                        "(default: ledger.retention.READERS)")
    args = parser.parse_args()
    from ledger.archive import DirectoryStore, open_store
    from ledger.config import RetentionPolicy, Settings
    from ledger.db import ProcessPool
    from ledger.retention import Retention

    work = Path(tempfile.mkdtemp(prefix="ledger-retention-bench-"))
    cleanup = Cleanup("retention-bench")
    try:
        url = migrated_database(cleanup, "retention_bench", partitioned=args.partitioned)
        print(f"filling {args.events:,} events over {DAYS} days", flush=True)
        fill(url, args.events)
        if args.s3:
            from devkit.servers import MotoS3

            s3 = MotoS3(work / "moto.log").start()
            cleanup.add("moto", s3.stop)
            s3.create_bucket("bench-archive")
            os.environ.update(s3.client_env)
            store = open_store("s3://bench-archive/ledger")
        else:
            store = DirectoryStore(work / "archive")
        policy = RetentionPolicy(processed_days=90, failed_days=120)
        pool = ProcessPool(Settings(database_url=url), name="retention-bench")
        cleanup.add("pool", pool.close)
        from ledger.retention import READERS

        runner = Retention(pool, store, policy, readers=args.readers or READERS)
        writers = None
        if args.writers:
            writers = Writers(url, args.writers).start()
            cleanup.add("writers", writers.stop)
            time.sleep(20)
            writers.phase = "during"
        cpu_before = cpu_times()
        report = runner.run()
        busy = busy_share(cpu_before, cpu_times())
        if writers is not None:
            writers.stop()
            print(f"receiver's statement at {args.writers:g}/s: {writers.summary()}", flush=True)
        archive_bytes = sum(row["bytes"] for row in runner.catalogued_files())
        with psycopg.connect(url) as conn:
            left = conn.execute("SELECT count(*) FROM ledger.events").fetchone()[0]
        archive_s = report.read_s + report.store_s
        archive_eps = report.archived / archive_s if archive_s else 0.0
        verdict = "PASS" if archive_eps >= TARGET_ARCHIVE_EPS else "FAIL"
        print(f"""
retention run {report.status} on {args.events:,} events ({'S3, moto server' if args.s3 else 'a directory'}):
  archived {report.archived:,} in {len(report.files)} files, {archive_bytes / 1e6:.1f} MB
  reading and compressing: {report.read_s:.1f} s; writing and reading back: {report.store_s:.1f} s
  archive rate: {archive_eps:,.0f} events/s (target >= {TARGET_ARCHIVE_EPS:,}: {verdict})
  removed {report.removed:,} in {report.remove_s:.1f} s = {report.removed / report.remove_s if report.remove_s else 0:,.0f} events/s;
  longest removal transaction {report.longest_removal_s * 1000:.0f} ms
  months left as tables {report.partitions_dropped} (events they kept, in new partitions: \
{report.kept_in_month:,}); longest swap transaction {report.longest_drop_s * 1000:.0f} ms; \
months that stayed (tables locked) {report.months_deferred}
  whole run {report.seconds:.1f} s; machine busy {busy:.0%}; events left {left:,}
SUMMARY retention events={args.events} archived={report.archived} archive_eps={archive_eps:.0f} \
read_s={report.read_s:.2f} store_s={report.store_s:.2f} remove_s={report.remove_s:.2f} \
longest_removal_ms={report.longest_removal_s * 1000:.0f} partitions_dropped={report.partitions_dropped} \
longest_drop_ms={report.longest_drop_s * 1000:.0f} months_deferred={report.months_deferred} bytes={archive_bytes} busy={busy:.2f}""", flush=True)
        return 0 if report.status == "done" else 1
    finally:
        cleanup.run()


if __name__ == "__main__":
    raise SystemExit(main())
