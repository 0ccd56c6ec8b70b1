"""Re-projection on a large ledger: ``ops/bench reproject`` (issue 31's targets; docs/benchmarks.md,
"Re-projection").

The bench's ledger gets ``SCENARIO_EVENTS`` processed events written straight into ledger.events: the
subscription lifecycles the other scenarios send (customer, subscription changes, invoices; about 4 KB
each, as Stripe sends them), one template of 10,000 events issued again under fresh ids, each copy
shifted in time, over 180 days. The README stack runs (the receiver, the documented worker pools), and
a paced client sends signed deliveries at ``ACK_RATE`` a second, open loop, from a window before the
first rebuild to a window after the last. Two rebuilds, each ``ledgerctl reproject start`` then
``apply`` (processes of their own, as an operator runs them): the first switches in tables built from
the whole ledger (the live ones hold only the client's events), the second rebuilds again and switches
tables built from the whole ledger for tables built from it, the apply lock issue 31 bounds.

Printed per rebuild: events a second (the whole rebuild: the queue, the main pass and the catch-ups of
the events the workers processed meanwhile), the CPU it cost per event (``ledgerctl``'s processes,
every Postgres process), the machine's busy share, the apply's lock; and the acknowledgements' p50,
p99 and max in each window.

    ops/bench reproject [--quick]
"""
from __future__ import annotations

import io
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import psycopg

from ledger.stripe_events import object_and_customer

from .retention import ACK_RATE, ACK_WINDOW_S, PacedClient

SCENARIO_EVENTS = 1_000_000
TEMPLATE_LIFECYCLES = 1_000  # 10,000 events
SPAN_S = 180 * 86400
TARGET_EPS = 5_000
TARGET_ACK_P99_MS = 100.0
TARGET_LOCK_MS = 1000.0
TARGETS = {
    "rebuild_5k": "a 1,000,000-event ledger rebuilds at >= 5,000 events/s",
    "ack_p99_100ms": "live traffic at 100 events/s meanwhile: ack p99 < 100 ms, every event processed",
    "apply_lock_1s": "apply's lock <= 1 s on tables built from 1,000,000 events",
}
_ID = re.compile(r'"((?:evt|cus|sub|si|in|price|prod|pi|ch|cs|pm)_[A-Za-z0-9]+)"')
_CREATED = re.compile(r'"(created|current_period_start|current_period_end|period_start|period_end|trial_end|'
                      r'canceled_at|ended_at|start_date|billing_cycle_anchor)": (\d+)')


def fill_history(url: str, total: int, log) -> dict[str, Any]:
    """``total`` processed events (the template's copies) into ledger.events by COPY."""
    from . import payloads

    # As the receiver records each: its object's and its customer's ids beside the payload.
    template = [(e["type"], e["created"], payloads.body(e), object_and_customer(e["data"]["object"]))
                for e in payloads.lifecycles(TEMPLATE_LIFECYCLES, seed=31, window_s=3600)]
    copies = -(-total // len(template))
    step = SPAN_S // copies
    first = min(created for _, created, _, _ in template)
    started = time.monotonic()
    written = 0
    with psycopg.connect(url, autocommit=True) as conn:
        for copy in range(copies):
            suffix = f"{copy:05x}"
            shift = step * copy - SPAN_S - (first - int(time.time()))
            rows = io.StringIO()
            for event_type, created, body, keys in template[:total - written]:
                text = _ID.sub(lambda m: f'"{m[1]}x{suffix}"', body)
                text = _CREATED.sub(lambda m: f'"{m[1]}": {int(m[2]) + shift}', text)
                evt_id = _ID.search(text)[1]
                object_id, customer_id = (f"{k}x{suffix}" if k else "\\N" for k in keys)
                rows.write("\t".join((evt_id, event_type, str(created + shift), _copy_text(text), object_id,
                                      customer_id)) + "\n")
            rows.seek(0)
            with conn.cursor() as cur, _history_copy(cur) as copy_:
                copy_.write(rows.getvalue())
            written = min(total, written + len(template))
            if copy % 10 == 9 or written == total:
                _flush(conn)
                log(f"  history: {written:,} events ({time.monotonic() - started:.0f} s)")
        _flush(conn)
        conn.execute("VACUUM ANALYZE ledger.events")
        size_mb = conn.execute("SELECT pg_database_size(current_database()) / 1e6").fetchone()[0]
    return {"events": written, "seconds": time.monotonic() - started, "database_mb": float(size_mb)}


def _copy_text(value: str) -> str:
    """A value as COPY's text format reads it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def _history_copy(cur):
    cur.execute("CREATE TEMP TABLE IF NOT EXISTS history (id text, type text, created bigint, payload text, "
                "object_id text, customer_id text)")
    return cur.copy("COPY history (id, type, created, payload, object_id, customer_id) FROM STDIN")


def _flush(conn) -> None:
    """The staged copies into the ledger, as processed events."""
    conn.execute("""
        INSERT INTO ledger.events (id, type, status, attempts, stripe_created, livemode, api_version, payload,
                                   received_at, wakeup_at, processed_at, updated_at, object_id, customer_id)
        SELECT id, type, 'processed', 1, to_timestamp(created), false, payload::json ->> 'api_version', payload::json,
               to_timestamp(created), to_timestamp(created), to_timestamp(created + 1), to_timestamp(created + 1),
               object_id, customer_id
          FROM history""")
    conn.execute("TRUNCATE history")


class EndlessDeliveries:
    """The paced client's deliveries, made as it sends them (a template re-issued under a new event id and
    signed then), as many as rebuilds of unknown length need: the first full run, with a list sized in
    advance, ran out of them 645 s into the second rebuild."""

    def __init__(self, templates: list[dict[str, Any]], secret: str, seed: int):
        self._templates, self._secret = templates, secret
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, n: int):
        from . import payloads

        with self._lock:
            evt = dict(self._rng.choice(self._templates))
        evt["id"] = payloads.event_id()
        text = payloads.body(evt)
        return payloads.SignedDelivery(evt["id"], text, payloads.sign(text, self._secret))


def _postgres_cpu_s() -> float:
    """CPU seconds of every process named postgres on the machine (the bench's private server and the
    machine's own, which nothing else uses meanwhile)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as fh:
                if not fh.read().startswith("postgres"):
                    continue
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15])
        except OSError:
            continue
    return total / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _ledgerctl(b, *args: str) -> dict[str, Any]:
    """``ledgerctl reproject ARGS --json``'s answer, with the process's peak RSS in MB (``_peak_rss_mb``: the
    rebuild's memory is bounded by its slice, not by the ledger)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen([b.checkout.tool("ledgerctl"), "reproject", *args, "--json"], env=b.env,
                                   stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if process.returncode != 0:
            raise RuntimeError(f"ledgerctl reproject {' '.join(args)} exited {process.returncode}: "
                               f"{err.read()[-2000:]}")
        answer = json.loads(out.read())
    answer["_peak_rss_mb"] = usage.ru_maxrss / 1024  # kB on Linux
    return answer


def _rebuild(b, log, name: str) -> dict[str, Any]:
    """``ledgerctl reproject start`` then ``apply``, each measured."""
    from .stack import MachineCpu

    machine = MachineCpu().begin()
    pg0, own0 = _postgres_cpu_s(), _children_cpu_s()
    started = time.monotonic()
    run = _ledgerctl(b, "start")
    seconds = time.monotonic() - started
    busy = machine.end()["busy"]
    pg_s, own_s = _postgres_cpu_s() - pg0, _children_cpu_s() - own0
    events = run["total"] + run["caught_up"]
    applied = _ledgerctl(b, "apply", "--yes")
    result = {"events": run["total"], "caught_up": run["caught_up"], "seconds": seconds,
              "events_per_s": run["total"] / seconds, "busy": busy,
              "pg_us_per_event": 1e6 * pg_s / events, "ledgerctl_us_per_event": 1e6 * own_s / events,
              "lock_ms": applied["lock_ms"], "applied_caught_up": applied["caught_up"] - run["caught_up"],
              "peak_rss_mb": run["_peak_rss_mb"]}
    log(f"  {name}: {run['total']:,} events (+{run['caught_up']:,} caught up) in {seconds:.1f} s = "
        f"{result['events_per_s']:,.0f}/s; CPU per event: ledgerctl {result['ledgerctl_us_per_event']:.0f} us, "
        f"Postgres {result['pg_us_per_event']:.0f} us; machine {100 * busy:.0f}% busy; apply's lock "
        f"{result['lock_ms']:.0f} ms; the rebuild's peak RSS {result['peak_rss_mb']:.0f} MB")
    return result


def scenario(b) -> dict[str, Any]:
    """ops/bench reproject: the history filled, then the paced client and the README workers around two
    rebuilds and their applies (see the module's docstring)."""
    from .scenarios import SECRET, history_label, log
    from .stack import MachineCpu

    total = 100_000 if b.opts.quick else SCENARIO_EVENTS
    b.label = "empty"
    b.clear()
    log(f"reproject: writing a history of {history_label(total)} processed events")
    history = fill_history(b.db.url, total, log)
    rc = b.receiver()
    deliveries = EndlessDeliveries(b.templates, SECRET, seed=331)
    phases: dict[str, Any] = {}
    rebuilds: dict[str, Any] = {}
    with b.readme_fleet():
        client = PacedClient(rc.port, deliveries, ACK_RATE).start()
        try:
            for phase in ("before", "first rebuild", "second rebuild", "after"):
                client.phase = phase
                machine = MachineCpu().begin()
                started = time.monotonic()
                if phase.endswith("rebuild"):
                    log(f"reproject: {phase}, {ACK_RATE:g} deliveries/s meanwhile")
                    rebuilds[phase] = _rebuild(b, log, phase)
                else:
                    time.sleep(ACK_WINDOW_S)
                phases[phase] = {"seconds": time.monotonic() - started, "busy": machine.end()["busy"]}
        finally:
            client.stop()
        # The last deliveries were acknowledged a moment ago: every event is processed once the workers caught up.
        deadline = time.monotonic() + 60
        while (unfinished := b.db.q("SELECT count(*) FROM ledger.events WHERE status <> 'processed'")[0][0]) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
    for phase in phases:
        phases[phase].update(client.summary(phase))
        s = phases[phase]
        log(f"  {phase:<15} {s['acks']:5d} acks p50 {s['p50_ms']:6.1f} ms p99 {s['p99_ms']:6.1f} ms max "
            f"{s['max_ms']:7.1f} ms errors {s['errors']} ({s['seconds']:.0f} s, machine {100 * s['busy']:.0f}% busy)")
    b.clear()
    during = [phases[p] for p in ("first rebuild", "second rebuild")]
    targets = {
        "rebuild_5k": min(r["events_per_s"] for r in rebuilds.values()) >= TARGET_EPS,
        "ack_p99_100ms": max(p["p99_ms"] for p in during) < TARGET_ACK_P99_MS
        and sum(p["errors"] for p in phases.values()) == 0 and unfinished == 0,
        "apply_lock_1s": rebuilds["second rebuild"]["lock_ms"] <= TARGET_LOCK_MS,
    }
    return {"events": total, "history": history, "rebuilds": rebuilds, "phases": phases, "rate": ACK_RATE,
            "unfinished_after": unfinished, "targets": targets}


def summary(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The scenario's text for the report, and its key figures."""
    lines = [f"history: {result['events']:,} processed events (database {result['history']['database_mb']:.0f} MB)", "",
             "| rebuild | events | caught up | seconds | events/s | ledgerctl µs/event | Postgres µs/event | "
             "machine busy | apply's lock ms | peak RSS MB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {r['events']:,} | {r['caught_up']:,} | {r['seconds']:.1f} | {r['events_per_s']:,.0f} | "
              f"{r['ledgerctl_us_per_event']:.0f} | {r['pg_us_per_event']:.0f} | {100 * r['busy']:.0f}% | "
              f"{r['lock_ms']:.0f} | {r.get('peak_rss_mb', 0):.0f} |" for name, r in result["rebuilds"].items()]
    lines += ["", f"acknowledgements at {result['rate']:g}/s (paced, open loop), README workers running; "
              f"events not processed at the end: {result['unfinished_after']}", "",
              "| window | acks | p50 ms | p99 ms | max ms | errors | machine busy |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {s['acks']} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['max_ms']:.1f} | {s['errors']} | "
              f"{100 * s['busy']:.0f}% |" for name, s in result["phases"].items()]
    lines += [""] + [f"- {TARGETS[key]}: **{'met' if ok else 'not met'}**" for key, ok in result["targets"].items()]
    values = {f"{name.split()[0]}_events_per_s": r["events_per_s"] for name, r in result["rebuilds"].items()}
    values.update({f"{name.split()[0]}_lock_ms": r["lock_ms"] for name, r in result["rebuilds"].items()})
    values.update({f"{name.split()[0]}_peak_rss_mb": r.get("peak_rss_mb") for name, r in result["rebuilds"].items()})
    values.update({f"ack_p99_{name.replace(' ', '_')}_ms": s["p99_ms"] for name, s in result["phases"].items()})
    values.update({f"target_{key}": "met" if ok else "not_met" for key, ok in result["targets"].items()})
    return "\n".join(lines), values
