"""Retention on a large ledger: how fast a run archives and removes, and how long its removals hold locks
(docs/benchmarks.md, "Retention").

A private PostgreSQL (the bench's settings) gets the ledger's schema and ``--events`` rows written straight
by SQL, received evenly over the last 180 days: 97% processed, 1% failed_permanent, the rest unfinished
(received, failed_recoverable, processing), each with a delivery and, for failures, an attempt; payloads
of about 1.5 KB, pretty-printed as Stripe sends them. Then one retention run (processed kept 90 days,
failed_permanent 120) into an archive directory, or with ``--s3`` a bucket of a moto server process, over
HTTP. Printed: events archived per second (reading, compressing, writing and reading back the files),
removed per second, the longest removal transaction, the archive's size, the machine's busy share, and
the run's CPU per archived event (the private server's, this process's, and its line builders').
``--max-rate`` and ``--builders`` set the run's budget (default: LEDGER_RETENTION_*'s); "alone" in issue
41's targets is ``--partitioned --max-rate 0``.

``--writers RATE``: meanwhile, new events are recorded at RATE a second through the receiver's own
statement (ledger.deliveries.EventStore.record_delivery, on a pool of its own), from 20 s before the run
to its end; printed: that statement's latency (p50, p99, max) before the run and during it, the stage
a receiver's acknowledgement waits on (a diagnostic, not the receiver's ack time).

    ops/devkit-run devkit.benchmarks.retention [--events 3000000] [--s3] [--partitioned] [--writers 100]
                                               [--max-rate N] [--builders N]

``scenario`` below is ``ops/bench retention``: the same run as users run the stack, beside an empty ledger.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from devkit.benchmarks.console_list import busy_share, cpu_times
from devkit.benchmarks.stack import migrated_database, partition, partition_months
from devkit.procs import Cleanup

# Issue 41's targets: alone (this module's main, the cap off), and beside the stack (the scenario, default budget).
TARGET_ARCHIVE_EPS = 30_000
TARGET_ARCHIVE_EPS_BUDGET = 10_000
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


def quantile(values: list[float], share: float) -> float:
    """The value ``share`` of the way up ``values`` (0 for none)."""
    return sorted(values)[min(len(values) - 1, int(share * len(values)))] if values else 0.0


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
        return "; ".join(f"{phase} ({len(v)}): p50 {quantile(v, 0.5):.1f} ms, p99 {quantile(v, 0.99):.1f} ms, "
                         f"max {max(v or [0]):.1f} ms"
                         for phase, v in self.latencies.items()) + f"; errors {self.errors}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=3_000_000)
    parser.add_argument("--s3", action="store_true", help="archive into a bucket of a moto server process")
    parser.add_argument("--partitioned", action="store_true", help="partition the ledger first (by month)")
    parser.add_argument("--writers", type=float, default=0.0, help="new events a second recorded meanwhile "
                        "through the receiver's statement (0: none)")
    parser.add_argument("--max-rate", type=float, default=None, help="archive events a second at most "
                        "(default: LEDGER_RETENTION_MAX_RATE's; 0: no cap)")
    parser.add_argument("--builders", type=int, default=None, help="processes building lines "
                        "(default: LEDGER_RETENTION_BUILDERS')")
    args = parser.parse_args()
    from ledger.archive import DirectoryStore, open_store
    from ledger.config import RetentionPolicy, Settings
    from ledger.db import ProcessPool
    from ledger.retention import Retention

    work = Path(tempfile.mkdtemp(prefix="ledger-retention-bench-"))
    cleanup = Cleanup("retention-bench")
    try:
        servers: list = []
        url = migrated_database(cleanup, "retention_bench", partitioned=args.partitioned, servers=servers)
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
        from dataclasses import replace

        budget = Settings.from_env().retention_budget()
        budget = replace(budget, **{k: v for k, v in (("max_rate", args.max_rate), ("builders", args.builders))
                                    if v is not None})
        print(f"budget: {budget}", flush=True)
        # The server's CPU when the first file is verified: every file is written by then, none removed.
        archived_pg: list[float] = []
        runner = Retention(pool, store, policy, budget=budget,
                           before_removal=lambda _: archived_pg.append(servers[0].cpu_s()) if not archived_pg else None)
        writers = None
        if args.writers:
            writers = Writers(url, args.writers).start()
            cleanup.add("writers", writers.stop)
            time.sleep(20)
            writers.phase = "during"
        cpu_before = cpu_times()
        # Where the run's CPU goes: Postgres (every backend, reaped ones too) and this process (the runner's
        # compressing, writing and reading back; and the writers' client side, if any).
        pg_cpu0, own_cpu0 = servers[0].cpu_s(), sum(os.times()[:2])
        report = runner.run()
        pg_us = 1e6 * (servers[0].cpu_s() - pg_cpu0) / max(report.archived, 1)
        pg_archive_us = 1e6 * ((archived_pg or [pg_cpu0])[0] - pg_cpu0) / max(report.archived, 1)
        runner_us = 1e6 * (sum(os.times()[:2]) - own_cpu0) / max(report.archived, 1)
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
  CPU per archived event: Postgres {pg_us:.1f} µs, the runner's process {runner_us:.1f} µs, its builders \
{1e6 * report.build_cpu_s / max(report.archived, 1):.1f} µs (whole run, removal included; Postgres until the \
files were written: {pg_archive_us:.1f} µs)
SUMMARY retention events={args.events} archived={report.archived} archive_eps={archive_eps:.0f} \
read_s={report.read_s:.2f} store_s={report.store_s:.2f} remove_s={report.remove_s:.2f} \
longest_removal_ms={report.longest_removal_s * 1000:.0f} partitions_dropped={report.partitions_dropped} \
longest_drop_ms={report.longest_drop_s * 1000:.0f} months_deferred={report.months_deferred} bytes={archive_bytes} busy={busy:.2f} \
pg_cpu_us_per_event={pg_us:.1f} runner_cpu_us_per_event={runner_us:.1f}""", flush=True)
        return 0 if report.status == "done" else 1
    finally:
        cleanup.run()


if __name__ == "__main__":
    raise SystemExit(main())


# -- ops/bench retention: the README stack on a partitioned ledger, empty and with a history ------------

SCENARIO_EVENTS = 3_000_000
ACK_RATE = 100.0          # deliveries a second while retention runs: a busy account's steady traffic
ACK_WINDOW_S = 30.0       # each retention-free window, before the run and after it
ACK_P99_RATIO = 1.5       # ack p99 during the run: at most this times its value before the run,
ACK_P99_MS = 20.0         # and at most this
CONSOLE_REQUESTS = 20
TARGETS = {
    "ack_drain_10pct": "ack rate and drain rate with the history within 10% of the empty ledger's",
    "swap_1s": "a month past the window leaves in a swap holding locks <= 1 s",
    "ack_p99_budget": f"ack p99 during the run <= {ACK_P99_RATIO:g} x before it, and <= {ACK_P99_MS:g} ms",
    "archive_10k": f"archive >= {TARGET_ARCHIVE_EPS_BUDGET:,} events/s with the default budget",
    "console_100ms": "every console page <= 100 ms p95 with the history",
}


class PacedClient:
    """Signed deliveries POSTed to the receiver at a fixed rate, open loop: each is sent at its scheduled
    time whatever the earlier answers did, and its acknowledgement is timed from that time (a stalled
    receiver shows as latency, not as fewer requests). Each answer is kept under the phase it was
    scheduled in; an answer other than 2xx, or none, is an error."""

    def __init__(self, port: int, deliveries, rate: float, *, threads: int = 8):
        import threading

        self._port, self._deliveries, self._rate = port, deliveries, rate
        self.phase = "before"
        self.latencies: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"paced-{i}", daemon=True) for i in range(threads)]

    def _run(self) -> None:
        import http.client

        while not self._stop.is_set():
            with self._lock:
                n = self._next
                self._next += 1
                phase = self.phase
            if n >= len(self._deliveries):
                return
            due = self._started + n / self._rate
            wait = due - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                return
            d = self._deliveries[n]
            ok = False
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self._port, timeout=30)
                conn.request("POST", d.path, body=d.body.encode(), headers={
                    "Content-Type": "application/json", "Stripe-Signature": d.signature})
                ok = 200 <= conn.getresponse().status < 300
                conn.close()
            except OSError:
                pass
            with self._lock:
                if ok:
                    self.latencies.setdefault(phase, []).append((time.monotonic() - due) * 1000)
                else:
                    self.errors[phase] = self.errors.get(phase, 0) + 1

    def start(self) -> "PacedClient":
        self._started = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def summary(self, phase: str) -> dict[str, float]:
        values = self.latencies.get(phase, [])
        return {"acks": len(values), "p50_ms": quantile(values, 0.5), "p99_ms": quantile(values, 0.99),
                "max_ms": max(values or [0.0]), "errors": self.errors.get(phase, 0)}


def _console_pages(b, log) -> dict[str, Any]:
    """The console's pages (console_list's) on the ledger as it is, ``CONSOLE_REQUESTS`` times each."""
    from devkit.stack import Console

    from .console_list import PAGES, console_variables, measure, p, session

    console = Console({**b.env, **console_variables()}, b.work).start()
    try:
        client = session(console.url)
        pages = {name: path for name, path in PAGES.items() if path is not None and "evt_" not in path}
        rows = {}
        for name, path in pages.items():
            times = measure(client, console.url + path, CONSOLE_REQUESTS)
            rows[name] = {"p50_ms": p(times, 0.5), "p95_ms": p(times, 0.95), "max_ms": max(times)}
        worst = max(rows, key=lambda k: rows[k]["p95_ms"])
        log(f"  console: worst page {worst} p95 {rows[worst]['p95_ms']:.1f} ms")
        return {"pages": rows, "worst": worst, "worst_p95_ms": rows[worst]["p95_ms"]}
    finally:
        console.kill()


def _acks_around_a_run(b, log) -> dict[str, Any]:
    """The README workers and a paced client at ACK_RATE: a retention-free window, ``ledgerctl retention
    run`` (a process of its own, as an operator or the sweep runs it), another retention-free window."""
    import json as json_mod
    import subprocess

    from .stack import MachineCpu

    rc = b.receiver()
    seconds = 2 * ACK_WINDOW_S + 600
    deliveries = b.deliveries(b.templates, int(ACK_RATE * seconds), seed=311)
    archive = b.work / "retention-archive"
    env = {**b.env, "LEDGER_ARCHIVE_URL": str(archive), "LEDGER_RETAIN_PROCESSED_DAYS": "90",
           "LEDGER_RETAIN_FAILED_DAYS": "120"}
    phases: dict[str, Any] = {}
    with b.readme_fleet():
        client = PacedClient(rc.port, deliveries, ACK_RATE).start()
        try:
            for phase in ("before", "during", "after"):
                client.phase = phase
                machine = MachineCpu().begin()
                started = time.monotonic()
                if phase == "during":
                    log(f"retention: ledgerctl retention run, {ACK_RATE:g} deliveries/s meanwhile")
                    done = subprocess.run([b.checkout.tool("ledgerctl"), "retention", "run", "--json"], env=env,
                                          capture_output=True, text=True, timeout=3600)
                    if done.returncode != 0:
                        raise RuntimeError(f"ledgerctl retention run exited {done.returncode}: {done.stderr[-2000:]}")
                    run = json_mod.loads(done.stdout)
                else:
                    time.sleep(ACK_WINDOW_S)
                phases[phase] = {"seconds": time.monotonic() - started, "busy": machine.end()["busy"]}
        finally:
            client.stop()
    for phase in phases:
        phases[phase].update(client.summary(phase))
        s = phases[phase]
        log(f"  {phase:<6} {s['acks']:5d} acks p50 {s['p50_ms']:6.1f} ms p99 {s['p99_ms']:6.1f} ms max "
            f"{s['max_ms']:7.1f} ms errors {s['errors']} ({s['seconds']:.0f} s, machine {100 * s['busy']:.0f}% busy)")
    archive_s = run["read_s"] + run["store_s"]
    run["archive_eps"] = run["archived"] / archive_s if archive_s else 0.0
    run["archive_bytes"] = sum(f.stat().st_size for f in archive.rglob("*") if f.is_file())
    log(f"  run {run['status']}: archived {run['archived']:,} at {run['archive_eps']:,.0f} events/s (builders' CPU "
        f"{1e6 * run['build_cpu_s'] / max(run['archived'], 1):.0f} µs an event), removed "
        f"{run['removed']:,}; months replaced {run['partitions_dropped']} (longest swap "
        f"{1000 * run['longest_drop_s']:.0f} ms), deferred {run['months_deferred']}")
    return {"rate": ACK_RATE, "phases": phases, "run": run}


def scenario(b) -> dict[str, Any]:
    """ops/bench retention (issue 30's targets): the README stack on two partitioned ledgers of one server,
    one empty and one with a history of SCENARIO_EVENTS processed events over DAYS days written straight
    into the tables; ingest and drain on each, taking turns twice (empty, history, empty, history: the
    machine's drift falls on both); the console's pages with the history; acknowledgements at ACK_RATE a
    second before, during and after one retention run (processed kept 90 days, failed_permanent 120)."""
    from ledger.migrate import migrate

    from . import revisions
    from .scenarios import drain, history_label, ingest, log, prefill_history

    total = 100_000 if b.opts.quick else SCENARIO_EVENTS
    label = history_label(total)
    sides = {"empty": b.side, label: b._side(revisions.current(), "ledger_bench_history", migrate)}
    for name, side in sides.items():
        with b.using(side):
            if not b.db.one("SELECT ledger.is_partitioned()"):
                partition(b.db.url)
            b.label = "empty"
            b.clear()
    with b.using(sides[label]):
        with psycopg.connect(b.db.url, autocommit=True) as conn:
            partition_months(conn, DAYS)
        history = prefill_history(b, total, days=DAYS, step_s=DAYS * 86400 / total)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    try:
        for round_ in (1, 2):
            for name, side in sides.items():
                with b.using(side):
                    b.label = name
                    log(f"retention: ingest and drain [{name}], round {round_}")
                    rounds[name].append({"ingest": ingest(b), "drain": drain(b)})
        with b.using(sides[label]):
            b.label = label
            console = _console_pages(b, log)
            acks = _acks_around_a_run(b, log)
            b.clear()
    finally:
        b.label = "empty"

    # Each figure: its value on each ledger in each round, and the ratio of the rounds' means.
    empty, full = rounds["empty"], rounds[label]
    figures: dict[str, dict[str, Any]] = {}
    for i, level in enumerate(empty[0]["ingest"]["levels"]):
        figures[f"ingest req/s c={level['concurrency']}"] = {
            k: [r["ingest"]["levels"][i]["rps"] for r in rounds[n]] for k, n in (("empty", "empty"), ("history", label))}
    for i, run_ in enumerate(empty[0]["drain"]["runs"]):
        figures[f"drain events/s workers={run_['workers']}"] = {
            k: [r["drain"]["runs"][i]["events_per_s"] for r in rounds[n]] for k, n in (("empty", "empty"), ("history", label))}
    for f in figures.values():
        f["ratio"] = (sum(f["history"]) / len(f["history"])) / (sum(f["empty"]) / len(f["empty"]) or 1)
    ratios = {name: f["ratio"] for name, f in figures.items()}
    ph = acks["phases"]
    quiet_p99 = ph["before"]["p99_ms"]
    run = acks["run"]
    targets = {
        "ack_drain_10pct": min(ratios.values()) >= 0.9,
        "swap_1s": run["partitions_dropped"] > 0 and run["longest_drop_s"] <= 1.0,
        "ack_p99_budget": ph["during"]["p99_ms"] <= min(ACK_P99_RATIO * quiet_p99, ACK_P99_MS),
        "archive_10k": run["archive_eps"] >= TARGET_ARCHIVE_EPS_BUDGET,
        "console_100ms": console["worst_p95_ms"] <= 100.0,
    }
    return {"events": total, "days": DAYS, "history": history, "empty": empty, "full": full, "ratios": ratios, "figures": figures,
            "console": console, "acks": acks, "quiet_p99_ms": quiet_p99, "targets": targets}


def summary(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The scenario's text for the report, and its key figures."""
    lines = [f"partitioned ledger; history {result['events']:,} processed events over {result['days']} days "
             f"(database {result['history']['database_mb']:.0f} MB)", "",
             "| figure | empty, rounds 1 and 2 | with the history, rounds 1 and 2 | history / empty (means) |",
             "|---|---:|---:|---:|"]
    lines += [f"| {name} | {', '.join(f'{v:,.0f}' for v in f['empty'])} | {', '.join(f'{v:,.0f}' for v in f['history'])} "
              f"| {f['ratio']:.3f} |" for name, f in result["figures"].items()]
    ph, run = result["acks"]["phases"], result["acks"]["run"]
    lines += ["", f"acknowledgements at {result['acks']['rate']:g}/s (paced, open loop), README workers running:", "",
              "| window | acks | p50 ms | p99 ms | max ms | errors | machine busy |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {s['acks']} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['max_ms']:.1f} | {s['errors']} | "
              f"{100 * s['busy']:.0f}% |" for name, s in (("before the run", ph["before"]),
                                                         ("during the run", ph["during"]),
                                                         ("after the run", ph["after"]))]
    lines += ["", f"retention run {run['status']}: archived {run['archived']:,} events at {run['archive_eps']:,.0f}/s "
              f"(reading and compressing {run['read_s']:.1f} s, writing and reading back {run['store_s']:.1f} s), "
              f"{run['archive_bytes'] / 1e6:.0f} MB; removed {run['removed']:,}; months replaced "
              f"{run['partitions_dropped']} (kept {run['kept_in_month']:,}), longest swap "
              f"{1000 * run['longest_drop_s']:.0f} ms, months deferred {run['months_deferred']}; whole run "
              f"{run['seconds']:.0f} s",
              f"console, worst page: {result['console']['worst']} p95 {result['console']['worst_p95_ms']:.1f} ms", ""]
    lines += [f"- {TARGETS[key]}: **{'met' if ok else 'not met'}**" for key, ok in result["targets"].items()]
    values = {"min_ratio": min(result["ratios"].values()), "archive_eps": run["archive_eps"],
              "build_cpu_us": 1e6 * run["build_cpu_s"] / max(run["archived"], 1),
              "longest_swap_ms": 1000 * run["longest_drop_s"], "ack_p99_before_ms": ph["before"]["p99_ms"],
              "ack_p99_during_ms": ph["during"]["p99_ms"], "ack_p99_after_ms": ph["after"]["p99_ms"],
              "ack_errors": sum(s["errors"] for s in ph.values()), "console_worst_p95_ms": result["console"]["worst_p95_ms"],
              "months_replaced": run["partitions_dropped"], "months_deferred": run["months_deferred"]}
    values.update({f"target_{key}": "met" if ok else "not_met" for key, ok in result["targets"].items()})
    return "\n".join(lines), values
