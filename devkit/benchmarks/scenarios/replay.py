"""replay: `ledgerctl replay` of a failed_permanent backlog, unthrottled, and what it costs a live ingest at c=8."""
from __future__ import annotations

import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from devkit.benchmarks.runner import Bench, log, table
from devkit.benchmarks.workload import load_received
from devkit.procs import wait_until
from devkit.sql import SQL

HEADLINE = ("events_per_s", "live_slowdown")
REPLAY = ["replay", "--status", "failed_permanent", "--yes", "--rate", "1000000", "--why", "benchmark", "--json"]


def run(b: Bench) -> dict[str, Any]:
    o, rc, events = b.opts, b.receiver(), b.fresh_backlog(b.opts.replay_events)
    load_received(b.db.url, events, status_sql=SQL.bench_seed_failed_permanent)
    b.db.vacuum("ledger.events")
    b.wrk.run(rc.port, b.deliveries(b.templates, 300, seed=98), 8, max_duration_s=30)  # warm-up
    log(f"replay: live ingest alone (c=8, {o.ingest_s:.0f}s)")
    base = b.wrk.run(rc.port, b.deliveries(b.templates, 8_000 if o.quick else 40_000, seed=21), 8,
                     max_duration_s=o.ingest_s)
    b.drop_queue()
    log(f"replay: ledgerctl replay of {len(events)} failed_permanent events, live ingest (c=8) alongside")
    # The replay starts once live deliveries are recorded: it runs inside the live ingest (its rate then: the rows').
    feed = b.deliveries(b.templates, 10_000 if o.quick else max(5_000, int(base.rps * 40)), seed=22)
    ended, recorded_before = threading.Event(), b.db.one(SQL.bench_events_count)
    live = ThreadPoolExecutor(1).submit(b.wrk.run, rc.port, feed, 8, max_duration_s=600, poll_s=0.05,
                                        stop_when=ended.is_set)
    wait_until(lambda: live.done() or b.db.one(SQL.bench_events_count) >= recorded_before + 200, timeout_s=120,
               what="the live ingest's first deliveries")
    if live.done():
        raise RuntimeError(f"the live ingest did not start: {live.exception()}")
    with open(b.work / "replay.log", "wb") as out:
        try:  # killed at the timeout or on Ctrl-C; the live ingest stops once it ends
            proc = subprocess.run([b.checkout.tool("ledgerctl"), *REPLAY], env=b.env, cwd=b.checkout.root, stdout=out,
                                  stderr=out, stdin=subprocess.DEVNULL, start_new_session=True, timeout=600)
        finally:
            ended.set()
    live = live.result(timeout=120)
    live_during = b.db.one(SQL.bench_live_events_during_replay, {"ids": [e.id for e in events]})
    first, last, replayed = b.db.q(SQL.bench_replay_window)[0]
    seconds = float(last - first) if replayed > 1 else 0.0
    during = live_during / seconds if seconds else live.rps
    b.clear()
    return {"events": len(events), "replayed": replayed, "exit_code": proc.returncode, "seconds": seconds,
            "events_per_s": replayed / seconds if seconds else 0.0, "live_rps_alone": base.rps,
            "live_rps_during": during, "live_rps_wrk_run": live.rps, "live_p50_ms_alone": base.p50_ms,
            "live_p50_ms_during": live.p50_ms, "live_p99_ms_alone": base.p99_ms, "live_p99_ms_during": live.p99_ms,
            "live_errors": base.errors + live.errors, "live_slowdown": 1 - during / base.rps if base.rps else 0.0,
            "rate_option": "--rate 1000000 (unthrottled; the default is 50/s)"}


def report(r: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rows = [{"run": w, **{k: r[f"live_{k}_{w}"] for k in ("rps", "p50_ms", "p99_ms")}} for w in ("alone", "during")]
    columns = [("run", "live ingest, c=8", ""), *((k, k.replace("_", " "), ".1f") for k in ("rps", "p50_ms", "p99_ms"))]
    text = (f"{table(rows, columns)}\nreplayed {r['replayed']}/{r['events']} in {r['seconds']:.1f}s = "
            f"{r['events_per_s']:.0f} events/s ({r['rate_option']})")
    return text, {**{k: r[k] for k in ("replayed", "events_per_s", "live_rps_alone", "live_rps_during", "live_slowdown",
                                       "live_p99_ms_alone", "live_p99_ms_during")},
                  "errors": r["live_errors"] + r["events"] - r["replayed"]}
