"""receiver-cost: the receiver's CPU per request next to minimal_wsgi.py doing the same I/O, both under the same server
and settings, fed the same kind of deliveries by the same wrk load, taking turns (receiver, minimal, ...), on Redis."""
from __future__ import annotations

import json
import time
from typing import Any

from devkit.benchmarks.runner import QUEUE, Bench, log, receiver_kind, table
from devkit.benchmarks.stack import ProcessWatch
from devkit.benchmarks.workload import wakeup_template
from devkit.procs import REPO, cpu_seconds
from devkit.sql import SQL
from devkit.stack import Receiver

RECEIVER_COST_TARGET = 1.3  # the receiver's CPU per request within this factor of the minimal app's (issue 39)
HEADLINE = ("receiver_cpu_ms", "minimal_cpu_ms", "ratio", "within_1_3x")
COLUMNS = [("server", "server", ""), ("requests", "deliveries", ""), ("rps", "req/s", ".1f"), ("p99_ms", "p99", ".1f"),
           ("cpu_ms_per_request", "server CPU ms/request", ".3f"), ("postgres_cpu_ms_per_request", "Postgres", ".3f"),
           ("redis_cpu_ms_per_request", "Redis", ".3f"), ("errors", "errors", "")]


def _minimal_receiver(b: Bench) -> Receiver:
    """minimal_wsgi.py under the receiver's server and settings: this checkout's code, the active side's database."""
    env = {**b.env, "BENCH_WAKEUP_TEMPLATE": json.dumps(wakeup_template(b.broker_url, QUEUE)), "PYTHONPATH": str(REPO)}
    rc = Receiver(env, b.work, ready_path="/readyz", extra_args=("--backlog", "2048"),
                  **{k: getattr(b.opts, f"receiver_{k}") for k in ("server", "workers", "threads")})
    rc.cmd = [arg.replace("ingest.app:create_app", "devkit.benchmarks.minimal_wsgi:create_app") for arg in rc.cmd]
    rc.name = "minimal-wsgi"
    return rc


def _total(runs: list[dict[str, Any]]) -> dict[str, Any]:
    recorded = max(sum(r["recorded"] for r in runs), 1)
    return {"requests": sum(r["requests"] for r in runs), "recorded": recorded,
            "rps": sum(r["rps"] for r in runs) / len(runs), "p99_ms": max(r["p99_ms"] for r in runs),
            **{f"{p}cpu_ms_per_request": 1000 * sum(r[f"{p}cpu_s"] for r in runs) / recorded
               for p in ("", "postgres_", "redis_")}, "errors": sum(r["errors"] for r in runs)}


def _run(b: Bench, name: str, rc: Receiver, n: int, c: int) -> dict[str, Any]:
    """One server, warmed up, on an empty ledger; then ``n`` new deliveries at ``c``: its, Postgres' and Redis' CPU."""
    with b.started(name, rc):
        b.clear()
        b.wrk.run(rc.port, b.signed(b.steady_source.backlog(min(600, n))), c, max_duration_s=60)  # warm-up
        time.sleep(0.3)
        b.clear()
        deliveries = b.signed(b.steady_source.backlog(n))
        watch, pg0, broker0 = ProcessWatch(rc.pids), b.pg.cpu_s(), cpu_seconds(b.redis.pid)
        watch.begin()
        r = b.wrk.run(rc.port, deliveries, c, max_duration_s=600)
        deadline = time.monotonic() + 10
        while (recorded := b.db.one(SQL.bench_events_count)) < len(deliveries) and time.monotonic() < deadline:
            time.sleep(0.05)
        cpu, pg_s, broker_s = watch.cpu_s(), b.pg.cpu_s() - pg0, cpu_seconds(b.redis.pid) - broker0
    b.clear()
    run = {"server": name, "requests": len(deliveries), "recorded": recorded, "rps": r.rps, "p50_ms": r.p50_ms,
           "p99_ms": r.p99_ms, "errors": r.errors + (len(deliveries) - recorded), "cpu_s": sum(cpu.values()),
           "cpu_s_by_process": cpu, "postgres_cpu_s": pg_s, "redis_cpu_s": broker_s}
    run = {**run, **_total([run]), "recorded": recorded}  # its own figures kept, its CPU per request added
    log(f"  {name:<13} {r.rps:7.1f} req/s p99 {r.p99_ms:7.1f} ms | CPU {run['cpu_ms_per_request']:.3f} ms/request "
        f"(Postgres {run['postgres_cpu_ms_per_request']:.3f}, Redis {run['redis_cpu_ms_per_request']:.3f})")
    return run


def run(b: Bench) -> dict[str, Any]:
    o, settings = b.opts, {k: getattr(b.opts, f"receiver_{k}") for k in ("server", "workers", "threads")}
    n, c, kind = o.receiver_cost_requests, o.receiver_cost_connections, receiver_kind(**settings)
    log(f"receiver-cost: {n:,} new deliveries per run at c={c}, {o.receiver_cost_rounds} run(s) each, under {kind}")
    with b.using_broker("redis"):
        b.stop_receiver()
        runs = [_run(b, name, make(b), n, c) for _ in range(o.receiver_cost_rounds)  # taking turns
                for name, make in (("receiver", Bench.new_receiver), ("minimal WSGI", _minimal_receiver))]
    receiver, minimal = (_total([r for r in runs if r["server"] == s]) for s in ("receiver", "minimal WSGI"))
    ratio = receiver["cpu_ms_per_request"] / minimal["cpu_ms_per_request"] if minimal["cpu_ms_per_request"] else 0.0
    return {"server": kind, **{f"receiver_{k}": v for k, v in settings.items()}, "connections": c,
            "requests_per_run": n, "rounds": o.receiver_cost_rounds, "broker": "redis", "runs": runs,
            "receiver": receiver, "minimal": minimal, "ratio": ratio, "target": RECEIVER_COST_TARGET,
            "loadgen": "wrk 4 (1 thread, pre-signed requests replayed by a Lua script)"}


def report(r: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    receiver, minimal, met = r["receiver"], r["minimal"], r["ratio"] <= r["target"]
    totals = [{**r[k], "server": f"{k} (all runs)"} for k in ("receiver", "minimal")] * (r["rounds"] > 1)
    text = (f"{table(r['runs'] + totals, COLUMNS)}\nboth under {r['server']}, wrk at c={r['connections']}; "
            f"receiver CPU per request / minimal's: {r['ratio']:.2f}× (≤ {r['target']}×: {'' if met else 'not '}met)")
    return text, {"receiver_cpu_ms": receiver["cpu_ms_per_request"],
                  "minimal_cpu_ms": minimal["cpu_ms_per_request"], "ratio": r["ratio"], "receiver_rps": receiver["rps"],
                  "minimal_rps": minimal["rps"], "errors": receiver["errors"] + minimal["errors"],
                  "within_1_3x": "met" if met else "not_met"}
