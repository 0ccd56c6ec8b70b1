"""ingest: the receiver alone at each concurrency (wrk, pre-signed deliveries), beside pgbench sending
the receiver's own statements to the same database: the ratio is how close HTTP comes to Postgres."""
from __future__ import annotations

import time
from typing import Any

from devkit.benchmarks import payloads
from devkit.benchmarks.pg import run_pgbench
from devkit.benchmarks.runner import Bench, Meter, end_backends, log, table
from devkit.benchmarks.workload import ingest_scripts

COLUMNS = [("concurrency", "c", ""), ("rps", "req/s", ".1f"), ("p50_ms", "p50 ms", ".1f"), ("p95_ms", "p95 ms", ".1f"),
           ("p99_ms", "p99 ms", ".1f"), ("errors", "errors", ""), ("wrk_cpu_pct", "wrk CPU %", ".1f"),
           ("pgbench_tps", "pgbench tps", ".1f"), ("pgbench_p99_ms", "pgbench p99 ms", ".1f"),
           ("ingest_ratio", "ingest_ratio", ".3f")]
HEADLINE = ("rps_c8", "p99_ms_c8", "ingest_ratio_c8", "rps_c32", "p99_ms_c32", "errors")


def run(b: Bench) -> dict[str, Any]:
    opts = b.opts
    rc = b.receiver()
    b.clear()
    templates = b.templates
    log(f"ingest [{b.label}]: {len(templates)} payload templates "
        f"({payloads.size_stats(payloads.body(t) for t in templates)})")
    b.wrk.run(rc.port, b.deliveries(templates, 400, seed=99), 8, max_duration_s=30)  # warm-up
    sample = b.deliveries(templates, 8, seed=7)
    scripts, defines = ingest_scripts(b.work, sample)
    rows = []
    estimate = 500.0
    for c in opts.levels:
        count = int(min(60_000, max(1_500, estimate * opts.ingest_s * 1.8)))
        deliveries = b.deliveries(templates, count, seed=c)
        before = b.db.unfinished()
        # The receiver's cost per delivery, once per ledger (cost reads it from here when it ran).
        meters = b.results.setdefault("_meters", {}).setdefault(b.label, {})
        meter = Meter(b, rc.pids) if c == 8 and "cost_receiver" not in meters else None
        if meter:
            end_backends(b, "ingest")
            meter.begin_sql()
            meter.begin_cpu(b.db.unfinished)
        r = b.wrk.run(rc.port, deliveries, c, max_duration_s=opts.ingest_s)
        if meter:
            meter.end_cpu(b.db.unfinished)
            time.sleep(0.5)  # the last answers in flight
            end_backends(b, "ingest")
            meters["cost_receiver"] = meter.finish("event_record_delivery")
        recorded = b.db.unfinished() - before
        b.drop_queue()
        estimate = max(estimate, r.rps)
        pgb = run_pgbench(b.pg_parts, scripts, c, seconds=opts.ingest_s, defines=defines, log_dir=b.work)
        row = {"concurrency": c, "requests": r.requests, "recorded": recorded, "rps": r.rps, "p50_ms": r.p50_ms,
               "p95_ms": r.p95_ms, "p99_ms": r.p99_ms, "max_ms": r.max_ms,
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
            "receiver_threads": opts.receiver_threads, "seconds_per_level": opts.ingest_s,
            "loadgen": "wrk 4 (1 thread, pre-signed requests replayed by a Lua script)"}


def report(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    values: dict[str, Any] = {}
    for r in result["levels"]:
        c = r["concurrency"]
        values.update({f"rps_c{c}": r["rps"], f"p50_ms_c{c}": r["p50_ms"], f"p95_ms_c{c}": r["p95_ms"],
                       f"p99_ms_c{c}": r["p99_ms"], f"pgbench_tps_c{c}": r["pgbench_tps"],
                       f"ingest_ratio_c{c}": r["ingest_ratio"]})
    values.update(errors=sum(r["errors"] for r in result["levels"]), loadgen="wrk")
    return table(result["levels"], COLUMNS), values
