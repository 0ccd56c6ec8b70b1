"""scale: ingest, drain and one recovery sweep on the empty ledger, then again over a history of
--history-events processed events; every figure as history ÷ empty (1.0 unchanged, higher better)."""
from __future__ import annotations

import re
import statistics
import time
from typing import Any

import psycopg
from psycopg import sql as pg_sql

from devkit.benchmarks.runner import Bench, history_label, log, prefill_history, scenario, table
from devkit.benchmarks.workload import load_received
from devkit.sql import SQL, compose
from ledger.queries import SQL as LEDGER_SQL

HEADLINE = ("ingest_rps_ratio_c8", "drain_ratio_w1", "sweep_query_ratio", "min_ratio", "target_0_9")


def uses_partial(sweep: dict[str, Any]) -> bool:
    """The sweep reads ledger.events only through partial indexes of the unprocessed set (the primary
    key only for the outer UPDATE's lookups)."""
    plan, partial = sweep["plan"], set(sweep["partial_indexes"])
    if re.search(r"Seq Scan on events\b", plan):
        return False
    used = re.findall(r"(?:Index Scan|Index Only Scan) using (\w+) on events\b", plan)
    inner = [n for n in used + re.findall(r"Bitmap Index Scan on (\w+)", plan) if n != "events_pkey"]
    return bool(inner) and all(n in partial for n in inner)


def sweep(b: Bench) -> dict[str, Any]:
    """One sweep pass over an unprocessed set of 500 overdue received events, 300 scheduled retries
    and 200 live leases, and the plan of its query."""
    from ledger.attempts import WorkerLedger
    from ledger.db import ProcessPool
    from workers.app import make_celery
    from workers.sweep import Sweeper
    from workers.wakeup import Waker

    b.clear()
    events = b.source.backlog(1000)
    ids = [e.id for e in events]
    load_received(b.db.url, events)
    b.db.q(SQL.bench_seed_overdue_wakeups, {"ids": ids[:500]})
    b.db.q(SQL.bench_seed_scheduled_retries, {"ids": ids[500:800]})
    b.db.q(SQL.bench_seed_live_leases, {"ids": ids[800:]})
    b.db.vacuum("ledger.events")
    params = {"overdue_s": 15.0, "batch": 500}
    explain = compose(SQL.bench_explain, statement=pg_sql.SQL(LEDGER_SQL.event_sweep_overdue_wakeups))
    timings, plan = [], ""
    with psycopg.connect(b.db.url) as conn:
        for _ in range(15):
            plan = "\n".join(r[0] for r in conn.execute(explain, params).fetchall())
            conn.rollback()
            timings.append(float(plan.rsplit("Execution Time: ", 1)[1].split()[0]))
    celery = make_celery(b.settings)
    pool = ProcessPool(b.settings, name="bench-sweep", max_size=1)
    try:
        started = time.perf_counter()
        result = Sweeper(WorkerLedger(pool), Waker(celery), celery, b.settings).run_once()
        pass_ms = 1000 * (time.perf_counter() - started)
    finally:
        pool.close()
        celery.close()
    partial = [r[0] for r in b.db.q(SQL.bench_events_partial_indexes,
                                    {"pattern": "%WHERE (status = ANY%received%processing%"})]
    b.clear()
    out = {"pass_ms": pass_ms, "redriven": result.redriven, "query_ms_median": statistics.median(timings),
           "query_ms_min": min(timings), "plan": plan, "partial_indexes": partial}
    return {**out, "uses_partial_index": uses_partial(out)}


def run(b: Bench) -> dict[str, Any]:
    # The empty ledger's figures: this run's ingest and drain when they ran before, else measured now.
    empty = b.results.setdefault("_empty", {})
    for name in ("ingest", "drain"):
        if name not in empty:
            empty[name] = b.results.get(name) or scenario(name).run(b)
            b.results.setdefault(name, empty[name])
    log("scale: recovery sweep on the empty ledger")
    empty["sweep"] = sweep(b)
    history = prefill_history(b)
    b.label = history_label(b.opts.history_events)
    try:
        full_ingest, full_drain = scenario("ingest").run(b), scenario("drain").run(b)
        log("scale: recovery sweep with the history")
        full_sweep = sweep(b)
    finally:
        b.label = "empty"
    ratio = lambda a, z: a / z if z else 0  # noqa: E731
    ingest_ratios = {e["concurrency"]: {"rps": f["rps"] / e["rps"], "p99": ratio(e["p99_ms"], f["p99_ms"]),
                                        "pgbench": ratio(f["pgbench_tps"], e["pgbench_tps"])}
                     for e, f in zip(empty["ingest"]["levels"], full_ingest["levels"])}
    drain_ratios = {e["workers"]: {"events_per_s": ratio(f["events_per_s"], e["events_per_s"])}
                    for e, f in zip(empty["drain"]["runs"], full_drain["runs"])}
    es = empty["sweep"]
    sweep_ratio = {"pass": ratio(es["pass_ms"], full_sweep["pass_ms"]),
                   "query": ratio(es["query_ms_median"], full_sweep["query_ms_median"])}
    figures = [r["rps"] for r in ingest_ratios.values()] + [r["events_per_s"] for r in drain_ratios.values()] \
        + [sweep_ratio["query"]]
    return {"history": history, "ingest": full_ingest, "drain": full_drain, "sweep": full_sweep, "sweep_empty": es,
            "ingest_ratio": ingest_ratios, "drain_ratio": drain_ratios, "sweep_ratio": sweep_ratio,
            "min_ratio": min(figures), "target_met": min(figures) >= 0.9}


def report(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    figures = {f"ingest req/s c={c}": r["rps"] for c, r in result["ingest_ratio"].items()}
    figures.update({f"ingest p99 c={c}": r["p99"] for c, r in result["ingest_ratio"].items()})
    figures.update({f"drain events/s w={w}": r["events_per_s"] for w, r in result["drain_ratio"].items()})
    sweep = result["sweep_ratio"]
    figures.update({"sweep query time": sweep["query"], "sweep pass time": sweep["pass"]})
    pgbench = {f"ingest req/s c={c}": r["pgbench"] for c, r in result["ingest_ratio"].items()}
    h = result["history"]
    text = table([{"figure": k, "ratio": v, "pgbench": pgbench.get(k)} for k, v in figures.items()],
                 [("figure", "figure", ""), ("ratio", "history / empty", ".3f"), ("pgbench", "pgbench", ".3f")])
    text += (f"\nhistory: {h['events']:,} processed events, database {h['database_mb']:.0f} MB, written in "
             f"{h['total_s']:.0f}s\nsweep query plan with the history:\n" + result["sweep"]["plan"])
    low = min(figures.values())
    values = {f"ingest_rps_ratio_c{c}": r["rps"] for c, r in result["ingest_ratio"].items()}
    values.update({f"drain_ratio_w{w}": r["events_per_s"] for w, r in result["drain_ratio"].items()})
    values.update({"sweep_query_ratio": sweep["query"], "sweep_pass_ratio": sweep["pass"],
                   "sweep_query_ms_1m": result["sweep"]["query_ms_median"],
                   "sweep_partial_index_only": uses_partial(result["sweep"]), "min_ratio": low,
                   "below_0_9": ",".join(k.replace(" ", "_") for k, v in figures.items() if v < 0.9) or "none",
                   "target_0_9": "met" if low >= 0.9 else "not_met"})
    return text, values
