"""drain: worker fleets on a queued backlog (rows and wake-ups in place), per worker count and the
documented pools, on each broker taking turns. The rate is taken over a window once every worker is up
(--full-drain: to the end), with the machine's busy share, the stack's, and the deadlocks Postgres detected."""
from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

from devkit.benchmarks import payloads
from devkit.benchmarks.brokers import LABELS
from devkit.benchmarks.runner import README_POOLS, README_POOLS_LABEL, Bench, Meter, log, table, wait_drained
from devkit.benchmarks.stack import MachineCpu, ProcessWatch
from devkit.benchmarks.workload import load_received
from devkit.sql import SQL

COLUMNS = [("workers", "workers", ""), ("broker_label", "broker", ""), ("events", "backlog", ""),
           ("processed", "processed", ""), ("seconds", "seconds", ".1f"), ("events_per_s", "events/s", ".1f"),
           ("busy_pct", "machine busy %", ".0f"), ("stack_busy_pct", "of which workers+Postgres+broker %", ".0f"),
           ("deadlocks", "deadlocks", ""), ("attempts_deadlocked", "deadlocked attempts", ""), ("errors", "errors", "")]
HEADLINE = ("events_per_s_w1", "events_per_s_w4", "events_per_s_readme", "stack_busy_readme", "errors")


def _workers(b: Bench, n_events: int, workers: int, *, readme: bool) -> dict[str, Any]:
    opts = b.opts
    events = b.fresh_backlog(n_events)
    ids = [e.id for e in events]
    load_received(b.db.url, events)
    b.push_wakeups(ids)
    log(f"drain [{b.label}, {b.broker_label}]: {n_events:,} received events, " + (
        f"{README_POOLS['workers']} README workers (--concurrency {README_POOLS['concurrency']})" if readme
        else f"{workers} worker process(es)"))
    done = lambda: n_events - b.db.unfinished()  # noqa: E731
    meters = b.results.setdefault("_meters", {}).setdefault(b.label, {})
    holder: dict = {}  # one worker's cost per event, once per ledger (cost reads it from here)
    meter = (Meter(b, lambda: holder["fleet"].pids()) if not readme and workers == 1
             and b.broker == opts.brokers[0] and "cost_worker" not in meters else None)
    if meter:
        meter.begin_sql()  # before any worker exists: its counters start from zero
    deadlocks0 = b.deadlocks()
    machine = MachineCpu()
    with (b.readme_fleet() if readme else b.fleet(workers)) as fleet:
        holder["fleet"] = fleet
        time.sleep(opts.drain_warmup_s)
        if meter:
            meter.begin_cpu(done)
        ours = ProcessWatch(lambda: {**fleet.pids(), **b.broker_group()})  # workers' and broker's (+ Postgres)
        ours.begin()
        pg0, p0, t0 = b.pg.cpu_s(), done(), time.monotonic()
        machine.begin()
        if opts.full_drain:
            wait_drained(b, timeout_s=max(600, n_events / 5))
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
        meters["cost_worker"] = meter.finish(None)
    failed = b.db.one(SQL.bench_events_failed_count, {"ids": ids})
    eps = (p1 - p0) / (t1 - t0)
    run = {"workers": README_POOLS_LABEL if readme else workers, "broker": b.broker,
           "processes": README_POOLS["workers"] * README_POOLS["concurrency"] if readme else workers,
           "events": n_events, "processed": p1 - p0, "errors": failed, "seconds": t1 - t0, "events_per_s": eps,
           "busy": cpu["busy"], "iowait": cpu["iowait"],
           "stack_busy": sum(stack_cpu.values()) / ((t1 - t0) * (os.cpu_count() or 1)),
           "cpu_ms_per_event": {k: 1000 * v / max(p1 - p0, 1) for k, v in stack_cpu.items()},
           "deadlocks": b.deadlocks() - deadlocks0, "attempts_deadlocked": b.attempts_deadlocked(ids),
           "log_deadlocks": log_deadlocks, "mix": dict(Counter(e.type for e in events))}
    log(f"  {b.broker_label}: {eps:8.1f} events/s ({p1 - p0} in {t1 - t0:.1f}s), machine {100 * cpu['busy']:.0f}% "
        f"busy (iowait {100 * cpu['iowait']:.0f}%; workers, Postgres and broker {100 * run['stack_busy']:.0f}%), "
        f"deadlocks {run['deadlocks']} (attempts {run['attempts_deadlocked']}), errors {failed}")
    return run


def run(b: Bench) -> dict[str, Any]:
    opts = b.opts
    by_broker: dict[str, dict[str, Any]] = {br: {"runs": [], "readme": None} for br in opts.brokers}
    mix: dict[str, int] = {}
    for workers, readme in [(w, False) for w in opts.worker_counts] + [(README_POOLS["workers"], True)]:
        for broker in opts.brokers:
            with b.using_broker(broker):
                run = _workers(b, opts.drain_events, workers, readme=readme)
            mix = run.pop("mix")
            if readme:
                by_broker[broker]["readme"] = run
            else:
                by_broker[broker]["runs"].append(run)
    b.clear()
    first = opts.brokers[0]
    sample = b.source.backlog(min(opts.drain_events, 1000))
    return {"runs": by_broker[first]["runs"], "readme": by_broker[first]["readme"], "broker": first,
            "brokers": by_broker, "events": opts.drain_events, "mix": mix, "full_drain": opts.full_drain,
            "window_s": opts.drain_s, "readme_pools": README_POOLS,
            "payload": payloads.size_stats(e.body for e in sample)}


def report(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    first, values, rows = result["broker"], {}, []
    fleets: dict[str, dict[str, dict]] = {}  # fleet -> broker -> run
    for broker, found in result["brokers"].items():
        for r in [*found["runs"], *([found["readme"]] if found["readme"] else [])]:
            fleets.setdefault(str(r["workers"]), {})[broker] = r
    for fleet, per_broker in fleets.items():
        key = f"w{fleet}" if fleet.isdigit() else "readme"
        for broker, r in per_broker.items():
            rows.append({**r, "broker_label": LABELS[broker], "busy_pct": 100 * r["busy"],
                         "stack_busy_pct": 100 * r["stack_busy"]})
            prefix = "" if broker == first else f"{broker}_"
            values.update({f"{prefix}events_per_s_{key}": r["events_per_s"], f"{prefix}busy_{key}": r["busy"],
                           f"{prefix}stack_busy_{key}": r["stack_busy"], f"{prefix}deadlocks_{key}": r["deadlocks"]})
        if "redis" in per_broker and "amqp" in per_broker and per_broker["amqp"]["events_per_s"]:
            values[f"redis_vs_amqp_{key}"] = per_broker["redis"]["events_per_s"] / per_broker["amqp"]["events_per_s"]
    values["errors"] = sum(r["errors"] for r in rows)
    return table(rows, COLUMNS), values
