"""ops/bench reproject (issue 31's targets): two rebuilds (``ledgerctl reproject start``, ``apply``) of SCENARIO_EVENTS
processed events beside the README workers and the paced client; the 2nd apply's lock is the one issue 31 bounds."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import tempfile
import time
from functools import partial
from typing import Any

import psycopg

from ledger.stripe_events import object_and_customer

from .. import payloads
from ..paced import ACK_RATE, ack_table, around
from ..runner import history_label, log, table
from ..stack import MachineCpu

SCENARIO_EVENTS, TEMPLATE_LIFECYCLES, SPAN_S = 1_000_000, 1_000, 180 * 86400  # the template: 10,000 events
TARGET_EPS, TARGET_ACK_P99_MS, TARGET_LOCK_MS = 5_000, 100.0, 1000.0
TARGETS = {"rebuild_5k": "a 1,000,000-event ledger rebuilds at >= 5,000 events/s",
           "ack_p99_100ms": "live traffic at 100 events/s meanwhile: ack p99 < 100 ms, every event processed",
           "apply_lock_1s": "apply's lock <= 1 s on tables built from 1,000,000 events"}
_ID = re.compile(r'"((?:evt|cus|sub|si|in|price|prod|pi|ch|cs|pm)_[A-Za-z0-9]+)"')
_CREATED = re.compile(r'"(created|current_period_start|current_period_end|period_start|period_end|trial_end|'
                      r'canceled_at|ended_at|start_date|billing_cycle_anchor)": (\d+)')
FLUSH = """INSERT INTO ledger.events (id, type, status, attempts, stripe_created, livemode, api_version, payload,
                                      received_at, wakeup_at, processed_at, updated_at, object_id, customer_id)
SELECT id, type, 'processed', 1, to_timestamp(created), false, payload::json ->> 'api_version', payload::json,
       to_timestamp(created), to_timestamp(created), to_timestamp(created + 1), to_timestamp(created + 1), object_id,
       customer_id FROM history;
TRUNCATE history"""


def fill_history(url: str, total: int) -> dict[str, Any]:
    """``total`` processed events over SPAN_S by COPY: the other scenarios' lifecycles repeated under new ids."""
    template = [(e["type"], e["created"], payloads.body(e), object_and_customer(e["data"]["object"]))
                for e in payloads.lifecycles(TEMPLATE_LIFECYCLES, seed=31, window_s=3600)]
    copies = -(-total // len(template))
    step, first = SPAN_S // copies, min(created for _, created, _, _ in template)
    started, written = time.monotonic(), 0
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE history (id text, type text, created bigint, payload text, object_id text, "
                     "customer_id text)")
        for copy in range(copies):
            suffix, shift = f"{copy:05x}", step * copy - SPAN_S - (first - int(time.time()))
            rows = io.StringIO()
            for event_type, created, body, keys in template[:total - written]:
                text = _ID.sub(lambda m: f'"{m[1]}x{suffix}"', body)
                text = _CREATED.sub(lambda m: f'"{m[1]}": {int(m[2]) + shift}', text)
                text = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
                ids = (f"{k}x{suffix}" if k else "\\N" for k in keys)
                rows.write("\t".join((_ID.search(text)[1], event_type, str(created + shift), text, *ids)) + "\n")
            with conn.cursor() as cur, cur.copy("COPY history FROM STDIN") as copy_:
                copy_.write(rows.getvalue())
            written = min(total, written + len(template))
            if copy % 10 == 9 or written == total:
                conn.execute(FLUSH)
                log(f"  history: {written:,} events ({time.monotonic() - started:.0f} s)")
        conn.execute("VACUUM ANALYZE ledger.events")
        size_mb = conn.execute("SELECT pg_database_size(current_database()) / 1e6").fetchone()[0]
    return {"events": written, "seconds": time.monotonic() - started, "database_mb": float(size_mb)}


def _ledgerctl(b, *args: str) -> tuple[dict[str, Any], float, float]:
    """``ledgerctl reproject ARGS --json``'s answer, CPU seconds, peak RSS in MB (its slice's, not the ledger's)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen([b.checkout.tool("ledgerctl"), "reproject", *args, "--json"], env=b.env,
                                   stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        out.seek(0), err.seek(0)
        if code := os.waitstatus_to_exitcode(status):
            raise RuntimeError(f"ledgerctl reproject {' '.join(args)} exited {code}: {err.read()[-2000:]}")
        return json.loads(out.read()), usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024  # kB on Linux


def _rebuild(b, rebuilds: dict[str, Any], name: str) -> None:
    """``start`` then ``apply``: events/s and CPU/event (ledgerctl's, Postgres's) over all of start, catch-ups too."""
    log(f"reproject: {name}, {ACK_RATE:g} deliveries/s meanwhile")
    machine, pg0, started = MachineCpu().begin(), b.pg.cpu_s(), time.monotonic()
    run, own_s, rss_mb = _ledgerctl(b, "start")
    seconds, busy, pg_s = time.monotonic() - started, machine.end()["busy"], b.pg.cpu_s() - pg0
    events, applied = run["total"] + run["caught_up"], _ledgerctl(b, "apply", "--yes")[0]
    rebuilds[name] = {"events": run["total"], "caught_up": run["caught_up"], "seconds": seconds,
                      "events_per_s": run["total"] / seconds, "busy": busy, "pg_us_per_event": 1e6 * pg_s / events,
                      "ledgerctl_us_per_event": 1e6 * own_s / events, "lock_ms": applied["lock_ms"],
                      "applied_caught_up": applied["caught_up"] - run["caught_up"], "peak_rss_mb": rss_mb}


def run(b) -> dict[str, Any]:
    total = 100_000 if b.opts.quick else SCENARIO_EVENTS
    b.label = "empty"
    b.clear()
    log(f"reproject: writing a history of {history_label(total)} processed events")
    history = fill_history(b.db.url, total)
    rebuilds: dict[str, Any] = {}

    def unfinished() -> int:  # the last deliveries were just acknowledged: every event processed once caught up
        deadline = time.monotonic() + 60
        while (left := b.db.one("SELECT count(*) FROM ledger.events WHERE status <> 'processed'")) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    steps = {name: partial(_rebuild, b, rebuilds, name) for name in ("first rebuild", "second rebuild")}
    phases, left = around(b, {"before": None, **steps, "after": None}, seed=331, then=unfinished)
    b.clear()
    targets = {"rebuild_5k": min(r["events_per_s"] for r in rebuilds.values()) >= TARGET_EPS,
               "ack_p99_100ms": max(phases[p]["p99_ms"] for p in rebuilds) < TARGET_ACK_P99_MS
               and sum(p["errors"] for p in phases.values()) == 0 and left == 0,
               "apply_lock_1s": rebuilds["second rebuild"]["lock_ms"] <= TARGET_LOCK_MS}
    return {"events": total, "history": history, "rebuilds": rebuilds, "phases": phases, "rate": ACK_RATE,
            "unfinished_after": left, "targets": targets}


def report(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rebuilds, phases = result["rebuilds"], result["phases"]
    text = "\n".join([
        f"history: {result['events']:,} processed events (database {result['history']['database_mb']:.0f} MB)",
        table([{"rebuild": n, **r} for n, r in rebuilds.items()], [
            ("rebuild", "rebuild", ""), ("events", "events", ","), ("caught_up", "caught up", ","),
            ("seconds", "s", ".1f"), ("events_per_s", "events/s", ",.0f"), ("ledgerctl_us_per_event", "ledgerctl µs/ev",
            ".0f"), ("pg_us_per_event", "Postgres µs/ev", ".0f"), ("busy", "machine busy", ".0%"),
            ("lock_ms", "apply's lock ms", ".0f"), ("peak_rss_mb", "peak RSS MB", ".0f")]),
        ack_table(phases, f"; events not processed at the end: {result['unfinished_after']}")]
        + [f"- {TARGETS[k]}: {'met' if ok else 'NOT MET'}" for k, ok in result["targets"].items()])
    return text, {**{f"{n.split()[0]}_{k}": r[k] for k in ("events_per_s", "lock_ms", "peak_rss_mb")
                     for n, r in rebuilds.items()},
                  **{f"ack_p99_{n.replace(' ', '_')}_ms": s["p99_ms"] for n, s in phases.items()},
                  **{f"target_{k}": "met" if ok else "not_met" for k, ok in result["targets"].items()}}
