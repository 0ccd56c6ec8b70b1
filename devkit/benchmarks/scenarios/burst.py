"""burst: a backlog's worth of deliveries at once while 2 workers drain it; does the backlog slow the acks?"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import psycopg

from devkit.benchmarks.runner import Bench, ensure_recorded, log, run_stats, table, wait_drained
from devkit.benchmarks.workload import load_received
from devkit.sql import SQL

HEADLINE = ("ack_all_s", "ack_rps_vs_no_workers", "peak_oldest_unprocessed_s")
BURST_COLUMNS = [(k, k.replace("_", " "), ".1f" if k.endswith(("rps", "_ms")) else "")
                 for k in ("segment", "backlog_before", "backlog_after", "rps", "p50_ms", "p99_ms", "errors")]


def _poll(url: str, halt: threading.Event, samples: list[tuple[float, int, float]]) -> None:
    """Backlog depth and oldest-unprocessed age every 0.25 s, on a connection of its own."""
    with psycopg.connect(url, autocommit=True) as conn:
        while not halt.is_set():
            depth, age = conn.execute(SQL.bench_backlog_depth_and_age).fetchone()
            samples.append((time.time(), depth, float(age)))
            halt.wait(0.25)


def _corr(xs: list[float], ys: list[float]) -> float:
    return statistics.correlation(xs, ys) if len(xs) >= 3 and statistics.pstdev(xs) and statistics.pstdev(ys) else 0.0


def _ack_vs_backlog(b: Bench, port: int) -> dict[str, Any]:
    """The control, no worker running: the same ingest on no backlog, then on one as large as the drain's."""
    seconds, out = max(2.0, b.opts.ingest_s / 2), {}
    for name, backlog in (("no_backlog", 0), ("backlog", b.opts.drain_events)):
        b.clear()
        if backlog:  # rows and wake-ups in place
            events = b.source.backlog(backlog)
            load_received(b.db.url, events)
            b.push_wakeups([e.id for e in events])
        r = b.wrk.run(port, b.deliveries(b.templates, int(600 * seconds), seed=40 + backlog % 7),
                      b.opts.burst_connections, max_duration_s=seconds)
        out[name] = {"backlog": backlog, "rps": r.rps, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors}
    b.clear()
    none, full = out["no_backlog"], out["backlog"]
    return {**out, **{f"{k[:3]}_ratio": full[k] / none[k] if none[k] else 0.0 for k in ("rps", "p99_ms")}}


def run(b: Bench) -> dict[str, Any]:
    opts, rc, c, events = b.opts, b.receiver(), b.opts.burst_connections, b.fresh_backlog(b.opts.burst_events)
    ids, deliveries, samples, halt = [e.id for e in events], b.signed(events), [], threading.Event()
    size = len(deliveries) // 10  # 10 segments, the backlog read before and after each
    log(f"burst: {len(deliveries)} deliveries at c={c} while 2 workers run (nice {opts.burst_worker_nice})")
    poller = threading.Thread(target=_poll, args=(b.db.monitor_url, halt, samples), daemon=True)
    deadlocks0 = b.deadlocks()
    with b.fleet(2, label="burst", nice=opts.burst_worker_nice) as fleet:
        poller.start()
        try:
            started, rows = time.time(), []
            for k in range(10):
                before = b.db.unfinished()
                r = b.wrk.run(rc.port, deliveries[k * size:(k + 1) * size if k < 9 else None], c, max_duration_s=600)
                rows.append({"segment": k + 1, "backlog_before": before, "backlog_after": b.db.unfinished(),
                             **{f: getattr(r, f) for f in ("rps", "p50_ms", "p95_ms", "p99_ms", "errors", "requests")}})
            # Acknowledged means committed: wait for every row (what wrk left in flight or dropped is resent).
            resent, ack_s = ensure_recorded(b, rc, deliveries), time.time() - started
            wait_drained(b, timeout_s=max(300, len(events) / 10))
        finally:
            halt.set()
            poller.join(timeout=10)
        log_deadlocks = fleet.log_mentions("DeadlockDetected")
    b.wait_backends_gone("worker")
    deadlocks, attempts_deadlocked = b.deadlocks() - deadlocks0, b.attempts_deadlocked(ids)  # before the control
    stats, control = run_stats(b, ids), _ack_vs_backlog(b, rc.port)
    mid, last = [(r["backlog_before"] + r["backlog_after"]) / 2 for r in rows], stats["last_processed"]
    low = [r for r, m in zip(rows, mid) if m <= statistics.median(mid)]
    b.clear()
    return {"deliveries": len(deliveries), "connections": c, "workers": 2, "worker_nice": opts.burst_worker_nice,
            "segments": rows, "ack_all_s": ack_s, "processed_all_s": last - started,
            "ack_rps": len(deliveries) / ack_s, "processed_rps": stats["processed"] / (last - started) if last else 0,
            "peak_oldest_unprocessed_s": stats["max_wait_s"], "peak_backlog": max((s[1] for s in samples), default=0),
            "peak_oldest_unprocessed_sampled_s": max((s[2] for s in samples), default=0.0),
            "errors": sum(r["errors"] for r in rows) + stats["not_processed"], "resent": resent,
            **{f"corr_backlog_{k[:3]}": _corr(mid, [r[k] for r in rows]) for k in ("p50_ms", "p99_ms", "rps")},
            **{f"{k}_{h}_backlog": statistics.median(r[k] for r in p) if p else 0
               for k in ("p50_ms", "p99_ms") for h, p in (("low", low), ("high", [r for r in rows if r not in low]))},
            "timeline": [(t - started, d, age) for t, d, age in samples], "control": control, "broker": b.broker,
            "deadlocks": deadlocks, "attempts_deadlocked": attempts_deadlocked, "log_deadlocks": log_deadlocks}


def report(r: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    none, full = r["control"]["no_backlog"], r["control"]["backlog"]
    ratio = r["ack_rps"] / none["rps"] if none["rps"] else 0.0  # acks/s over the control's (target: within 10%)
    text = table(r["segments"], BURST_COLUMNS) + (
        f"\nall acked in {r['ack_all_s']:.1f}s ({r['ack_rps']:.0f}/s), processed {r['processed_all_s']:.1f}s; control, "
        f"no worker: {none['rps']:.0f} req/s on no backlog, {full['rps']:.0f} on {full['backlog']:,}")
    return text, {**{k: r[k] for k in ("deliveries", "ack_all_s", "processed_all_s", "peak_oldest_unprocessed_s",
                                       "peak_backlog", "corr_backlog_p50", "corr_backlog_p99", "p99_ms_low_backlog",
                                       "p99_ms_high_backlog", "errors", "resent")},
                  **{f"control_{m}_backlog{s}": c[m] for m in ("rps", "p99_ms")
                     for s, c in (("0", none), ("_full", full))},
                  "control_rps_ratio": r["control"]["rps_ratio"], "ack_rps_vs_no_workers": ratio,
                  "ack_within_10pct": "met" if ratio >= 0.9 else "not_met", "worker_nice": r["worker_nice"],
                  **{k: r[k] for k in ("deadlocks", "attempts_deadlocked", "log_deadlocks")}}
