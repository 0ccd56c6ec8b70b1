"""Tables, one-line ``key=value`` summaries, py-spy profile digests, the plot, and docs/benchmarks.md."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from .pg import statement_label


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([_fmt(row.get(k), spec) for k, _, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def md_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    out = ["| " + " | ".join(h for _, h, _ in columns) + " |",
           "|" + "|".join("---:" for _ in columns) + "|"]
    for row in rows:
        out.append("| " + " | ".join(_fmt(row.get(k), spec) for k, _, spec in columns) + " |")
    return "\n".join(out)


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    if spec and isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def kv(scenario: str, values: dict[str, Any]) -> str:
    parts = []
    for k, v in values.items():
        if isinstance(v, float):
            v = f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        parts.append(f"{k}={v}")
    return f"SUMMARY {scenario} " + " ".join(parts)


INGEST_COLUMNS = [("concurrency", "c", ""), ("rps", "req/s", ".1f"), ("p50_ms", "p50 ms", ".1f"),
                  ("p95_ms", "p95 ms", ".1f"), ("p99_ms", "p99 ms", ".1f"), ("errors", "errors", ""),
                  ("wrk_cpu_pct", "wrk CPU %", ".1f"), ("pgbench_tps", "pgbench tps", ".1f"),
                  ("pgbench_p99_ms", "pgbench p99 ms", ".1f"), ("ingest_ratio", "ingest_ratio", ".3f")]
DRAIN_COLUMNS = [("workers", "workers", ""), ("broker_label", "broker", ""), ("events", "backlog", ""),
                 ("processed", "processed", ""), ("seconds", "seconds", ".1f"),
                 ("events_per_s", "events/s", ".1f"), ("busy_pct", "machine busy %", ".0f"),
                 ("stack_busy_pct", "of which workers+Postgres+broker %", ".0f"),
                 ("deadlocks", "deadlocks", ""), ("attempts_deadlocked", "deadlocked attempts", ""),
                 ("errors", "errors", ""),
                 ("pgbench_tps", "pgbench tps", ".1f"), ("pgbench_statements_per_event", "stmts/tx", ".2f"),
                 ("drain_ratio", "drain_ratio", ".3f")]
def drain_fleets(result: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each fleet's run on each broker: {fleet: {broker: run}}, the worker counts first, then the documented pools."""
    by_broker = result.get("brokers") or {result.get("broker", "redis"): {"runs": result["runs"],
                                                                         "readme": result.get("readme")}}
    fleets: dict[str, dict[str, dict[str, Any]]] = {}
    for broker, found in by_broker.items():
        for run in [*found["runs"], *([found["readme"]] if found.get("readme") else [])]:
            fleets.setdefault(str(run["workers"]), {})[broker] = run
    return fleets


def drain_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every drain run as a table row: per fleet, one row per broker."""
    rows = []
    for per_broker in drain_fleets(result).values():
        for broker, run in per_broker.items():
            rows.append({**run, "broker_label": BROKER_LABELS.get(run.get("broker", broker), broker),
                         "busy_pct": 100 * run["busy"] if "busy" in run else None,
                         "stack_busy_pct": 100 * run["stack_busy"] if "stack_busy" in run else None})
    return rows


def drain_broker_ratios(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per fleet run on both brokers: Redis' events/s over RabbitMQ's, and each one's busy share."""
    out = {}
    for fleet, per_broker in drain_fleets(result).items():
        redis, amqp = per_broker.get("redis"), per_broker.get("amqp")
        if redis and amqp and amqp["events_per_s"]:
            out[fleet] = {"ratio": redis["events_per_s"] / amqp["events_per_s"], "redis_eps": redis["events_per_s"],
                          "amqp_eps": amqp["events_per_s"], "redis_busy": redis.get("busy", 0.0),
                          "amqp_busy": amqp.get("busy", 0.0), "redis_stack_busy": redis.get("stack_busy", 0.0),
                          "amqp_stack_busy": amqp.get("stack_busy", 0.0)}
    return out


def drain_ratio_lines(result: dict[str, Any]) -> list[str]:
    return [f"{fleet}: Redis {x['redis_eps']:.1f} / RabbitMQ {x['amqp_eps']:.1f} events/s = {x['ratio']:.2f}× "
            f"(machine busy {100 * x['redis_busy']:.0f}% on Redis, {100 * x['amqp_busy']:.0f}% on RabbitMQ; of which "
            f"workers, Postgres and broker {100 * x['redis_stack_busy']:.0f}% and {100 * x['amqp_stack_busy']:.0f}%)"
            for fleet, x in drain_broker_ratios(result).items()]


BURST_COLUMNS = [("segment", "segment", ""), ("backlog_before", "backlog before", ""),
                 ("backlog_after", "backlog after", ""), ("rps", "req/s", ".1f"), ("p50_ms", "p50 ms", ".1f"),
                 ("p99_ms", "p99 ms", ".1f"), ("errors", "errors", "")]


def burst_ack_ratio(burst: dict) -> float:
    """Deliveries acknowledged per second during the burst, over the control's rate with no worker running."""
    control = burst["control"]["no_backlog"]["rps"]
    return burst["ack_rps"] / control if control else 0.0


def burst_ack_target(burst: dict) -> bool:
    """The issue's target: acknowledgement during the burst within 10% of ingest with no worker running."""
    return burst_ack_ratio(burst) >= 0.9


def receiver_kind(server: str | None, workers: int, threads: int | None = None) -> str:
    """The receiver's server and configuration in words (``server`` None: a result recorded
    before the server was selectable, gunicorn sync or, with threads, gthread)."""
    from devkit.stack import DEFAULT_THREADS

    if server is None:
        server = "gunicorn-gthread" if (threads or 1) > 1 else "gunicorn-sync"
    threads = threads or DEFAULT_THREADS.get(server, 1)
    if server == "granian":
        return f"granian, {workers} workers of {threads} blocking threads"
    if server == "gunicorn-gthread":
        return f"gunicorn, {workers} gthread workers of {threads} threads"
    return f"gunicorn, {workers} sync workers"


def worker_round_trip_target(worker: dict) -> bool:
    """The issue's target: at most 2 transactions and 4 round trips per processed event (0.05 of counter slack)."""
    return worker["transactions_per_event"] <= 2.05 and worker["round_trips_per_event"] <= 4.05


def sweep_uses_partial(sweep: dict[str, Any]) -> bool:
    """True when the sweep reads ledger.events only through partial indexes of the unprocessed set
    (index, index-only or bitmap scans; the primary key only for the outer UPDATE's lookups)."""
    plan, partial = sweep["plan"], set(sweep.get("partial_indexes") or ())
    if re.search(r"Seq Scan on events\b", plan):
        return False
    used = re.findall(r"(?:Index Scan|Index Only Scan) using (\w+) on events\b", plan)
    used += re.findall(r"Bitmap Index Scan on (\w+)", plan)
    inner = [name for name in used if name != "events_pkey"]
    return bool(inner) and all(name in partial for name in inner)


def scale_figures(result: dict[str, Any]) -> dict[str, float]:
    """Every scale figure as a ratio where 1.0 is unchanged and higher is better."""
    out = {}
    for c, r in result["ingest_ratio"].items():
        out[f"ingest req/s c={c}"] = r["rps"]
        out[f"ingest p99 c={c}"] = r["p99"]
    for w, r in result["drain_ratio"].items():
        out[f"drain events/s w={w}"] = r["events_per_s"]
    out["sweep query time"] = result["sweep_ratio"]["query"]
    out["sweep pass time"] = result["sweep_ratio"]["pass"]
    return out


# -- steady ---------------------------------------------------------------------------------------

# The issue's targets for the whole stack (steady), all of the current revision.
STEADY_CPU_TARGET_MS = 2.0          # CPU per processed event, every process together (the client apart)
STEADY_E2E_RATIO_TARGET = 3.0       # end-to-end events/s against the compared revision's...
STEADY_E2E_RATIO_LEVELS = (8, 32)   # ...at these concurrencies
STEADY_P99_TARGET_MS = 50.0         # ack p99 with the workers running...
STEADY_P99_LEVEL = 32               # ...at this concurrency
# The process types whose CPU is summed (in this order); the client is reported apart. "broker" is the
# broker's server: the private Redis, or RabbitMQ (the machine's server, other vhosts' traffic included).
STEADY_CPU_GROUPS = ("receiver", "worker parents", "worker pool children", "sweep", "Postgres", "broker")
BROKER_CPU_GROUPS = ("Redis", "RabbitMQ")
BROKER_LABELS = {"redis": "Redis", "amqp": "RabbitMQ"}


def group_cpu(run: dict[str, Any], group: str) -> float:
    """A steady run's CPU ms per event of one process type ("broker": whichever broker it ran on)."""
    if group == "broker":
        return next((run["cpu_ms"][g] for g in BROKER_CPU_GROUPS if g in run["cpu_ms"]), 0.0)
    return run["cpu_ms"].get(group, 0.0)


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def steady_brokers(result: dict[str, Any]) -> list[str]:
    """The brokers a steady result ran on, the first one (``revisions``' own) first."""
    first = result.get("broker", "redis")
    return [first, *(b for b in result.get("brokers") or {} if b != first)]


def steady_revisions(result: dict[str, Any], broker: str | None = None) -> list[dict[str, Any]]:
    if broker is None or broker == result.get("broker", "redis") or not result.get("brokers"):
        return result["revisions"]
    return result["brokers"][broker]["revisions"]


def steady_sides(result: dict[str, Any], broker: str | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the current revision's runs, the compared revision's or None), on ``broker`` (default: the first)."""
    revs = steady_revisions(result, broker)
    current = next(r for r in revs if r["commit"] is None)
    return current, next((r for r in revs if r["commit"] is not None and not r.get("floor")), None)


def steady_floor(result: dict[str, Any], broker: str | None = None) -> dict[str, Any] | None:
    """The floor's runs (--floor: handlers that write nothing) on ``broker``, or None."""
    return next((r for r in steady_revisions(result, broker) if r.get("floor")), None)


def steady_peer(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The sync engine's runs by concurrency (empty when it did not run)."""
    found = result.get("peer") or {}
    return {r["concurrency"]: r for r in found.get("runs") or []}


def peer_ratio(run: dict[str, Any], peer_run: dict[str, Any] | None) -> float | None:
    """Our end-to-end events/s over the sync engine's (acknowledged and applied) at the same level."""
    return run["e2e_eps"] / peer_run["e2e_eps"] if peer_run and peer_run["e2e_eps"] else None


def _by_level(side: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    return {r["concurrency"]: r for r in side["runs"]} if side else {}


def steady_cpu_met(run: dict[str, Any]) -> bool:
    return run["cpu_ms_total"] <= STEADY_CPU_TARGET_MS


def steady_p99_met(run: dict[str, Any]) -> bool:
    return run["ack_p99_ms"] <= STEADY_P99_TARGET_MS


def steady_e2e_ratio(run: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    return run["e2e_eps"] / base["e2e_eps"] if base and base["e2e_eps"] else None


def steady_targets(result: dict[str, Any]) -> dict[str, tuple[str, str, bool]]:
    """Every target that applies to this run, by summary key: (target, what was measured, met)."""
    current, baseline = steady_sides(result)
    runs, base = _by_level(current), _by_level(baseline)
    out = {}
    worst = max(runs.values(), key=lambda r: r["cpu_ms_total"])
    out["cpu_2ms"] = (f"CPU per processed event, all processes together ≤ {STEADY_CPU_TARGET_MS} ms",
                      ", ".join(f"c={c}: {r['cpu_ms_total']:.2f}" for c, r in runs.items()), steady_cpu_met(worst))
    if STEADY_P99_LEVEL in runs:
        r = runs[STEADY_P99_LEVEL]
        out[f"p99_50ms_c{STEADY_P99_LEVEL}"] = (
            f"ack p99 ≤ {STEADY_P99_TARGET_MS:.0f} ms at {STEADY_P99_LEVEL} connections, workers running",
            f"{r['ack_p99_ms']:.1f} ms", steady_p99_met(r))
    if baseline:
        levels = [c for c in STEADY_E2E_RATIO_LEVELS if c in runs and c in base]
        ratios = {c: steady_e2e_ratio(runs[c], base[c]) or 0.0 for c in levels}
        if ratios:
            out["e2e_3x"] = (f"end-to-end events/s at {' and '.join(map(str, levels))} connections ≥ "
                             f"{STEADY_E2E_RATIO_TARGET:.0f}× {baseline['label']}'s",
                             ", ".join(f"c={c}: {v:.2f}×" for c, v in ratios.items()),
                             all(v >= STEADY_E2E_RATIO_TARGET for v in ratios.values()))
    return out


def steady_row(run: dict[str, Any], base: dict[str, Any] | None = None, *, targets: bool = True,
               peer_run: dict[str, Any] | None = None) -> dict[str, str]:
    """One level of one revision as table cells, each target next to the number it applies to; with
    ``peer_run``, the sync engine's events/s and ack p99 at the same level and our ratio to it."""
    c = run["concurrency"]
    p99 = f"{run['ack_p99_ms']:.1f}"
    if targets and c == STEADY_P99_LEVEL:
        p99 += f" (target ≤ {STEADY_P99_TARGET_MS:.0f}: {_met(steady_p99_met(run))})"
    e2e = f"{run['e2e_eps']:.1f}"
    ratio = steady_e2e_ratio(run, base)
    if targets and ratio is not None and c in STEADY_E2E_RATIO_LEVELS:
        e2e += (f" ({ratio:.2f}× the compared revision; target ≥ {STEADY_E2E_RATIO_TARGET:.0f}×: "
                f"{_met(ratio >= STEADY_E2E_RATIO_TARGET)})")
    total = f"{run['cpu_ms_total']:.2f}"
    if targets:
        total += f" (target ≤ {STEADY_CPU_TARGET_MS}: {_met(steady_cpu_met(run))})"
    row = {"c": str(c), "ack req/s": f"{run['ack_rps']:.1f}", "ack p50 ms": f"{run['ack_p50_ms']:.1f}",
           "ack p99 ms": p99, "end-to-end events/s": e2e}
    if peer_run is not None:
        ratio = peer_ratio(run, peer_run)
        row["sync engine events/s"] = f"{peer_run['e2e_eps']:.1f}"
        row["× sync engine"] = "-" if ratio is None else f"{ratio:.2f}" + (
            f" ({_met(ratio >= PEER_E2E_RATIO_TARGETS[c])})" if targets and c in PEER_E2E_RATIO_TARGETS else "")
        row["sync engine ack p99 ms"] = f"{peer_run['ack_p99_ms']:.1f}"
    row.update({"seconds": f"{run['e2e_s']:.1f}", "backlog at last ack": str(run["backlog_at_last_ack"])})
    if "deadlocks" in run:
        row["deadlocks"] = f"{run['deadlocks']}" + (f" ({run['attempts_deadlocked']} attempts)"
                                                   if run.get("attempts_deadlocked") else "")
    if "busy" in run:
        row["machine busy %"] = f"{100 * run['busy']:.0f}"
    row.update({g: f"{group_cpu(run, g):.2f}" for g in STEADY_CPU_GROUPS})
    row["total"] = total
    row.update(_per_event_counts(run))
    row["client: wrk"] = f"{run['client_cpu_ms']['wrk']:.2f}"
    if "stripe_api" in run:  # a thin level: the workers' fetches, and the fake that answered them
        row["Stripe API requests/event"] = f"{run['stripe_api']['per_event']:.2f}"
        row["client: fake Stripe API"] = f"{run['client_cpu_ms']['fake Stripe API']:.2f}"
    row["errors"] = str(run["errors"])
    return row


def _cells(rows: list[dict[str, str]]) -> list[tuple[str, str, str]]:
    return [(k, k, "") for k in rows[0]] if rows else []


def steady_table(result: dict[str, Any], *, markdown: bool = False, label: str | None = None,
                 broker: str | None = None) -> str:
    """One revision's levels (the current one by default) on ``broker`` (default: the first), next to
    the sync engine when it ran; CPU columns are ms per processed event."""
    current, baseline = steady_sides(result, broker)
    revs = steady_revisions(result, broker)
    side = next((r for r in revs if r["label"] == label), current) if label else current
    base = _by_level(baseline) if side is current else {}
    peer_runs = steady_peer(result)
    rows = [steady_row(r, base.get(r["concurrency"]), targets=side is current,
                       peer_run=peer_runs.get(r["concurrency"]) if peer_runs else None) for r in side["runs"]]
    return (md_table if markdown else table)(rows, _cells(rows))


# The targets of issue 39 that steady measures (rebuild and drain targets: their own scenarios' reports).
TARGETS_SOURCE = "issue 39"
PEER_E2E_RATIO_TARGETS = {8: 0.8, 32: 0.9}  # end-to-end events/s against the sync engine's, on Redis
EVENT_STATEMENTS_TARGET, EVENT_STATEMENTS_LEVEL = 4, 32  # Postgres statements per event on Redis
BROKER_RATIO_TARGET = 0.85       # RabbitMQ's end-to-end events/s against Redis', at every level
RECEIVER_COST_TARGET = 1.3       # receiver CPU per request against the minimal WSGI app's


def steady_side_by_side_rows(result: dict[str, Any]) -> list[dict[str, str]]:
    """The opening table: per level, the sync engine and this project on each broker, and the ratio."""
    peer_runs = steady_peer(result)
    levels = result["levels"]
    cols = lambda c: "1 connection" if c == 1 else f"{c} connections"  # noqa: E731
    rows = []

    def row(label: str, values: dict[int, str]) -> None:
        rows.append({"": label, **{cols(c): values.get(c, "-") for c in levels}})
    if peer_runs:
        row("sync engine, acknowledged and applied (events/s)",
            {c: f"{r['e2e_eps']:.0f}" for c, r in peer_runs.items()})
        row("sync engine, ack p99 (ms)", {c: f"{r['ack_p99_ms']:.0f}" for c, r in peer_runs.items()})
    for broker in steady_brokers(result):
        name = BROKER_LABELS.get(broker, broker)
        current, _ = steady_sides(result, broker)
        runs = _by_level(current)
        row(f"this project on {name}, processed end to end (events/s)",
            {c: f"{r['e2e_eps']:.0f}" for c, r in runs.items()})
        if peer_runs:
            row(f"ratio to the sync engine ({name})",
                {c: f"{peer_ratio(r, peer_runs.get(c)):.2f}" for c, r in runs.items() if peer_runs.get(c)})
        row(f"this project on {name}, ack p99 (ms)", {c: f"{r['ack_p99_ms']:.0f}" for c, r in runs.items()})
        row(f"this project on {name}, deadlocks detected", {c: str(r.get("deadlocks", "-")) for c, r in runs.items()})
        row(f"this project on {name}, CPU ms per event (all processes)",
            {c: f"{r['cpu_ms_total']:.2f}" for c, r in runs.items()})
        row(f"this project on {name}, statements / commits / broker commands per event",
            {c: _counts_cell(r) for c, r in runs.items() if "commits_per_event" in r})
    if peer_runs:
        row("sync engine, CPU ms per event (node and Postgres)",
            {c: f"{r['cpu_ms_total']:.2f}" for c, r in peer_runs.items()})
        row("sync engine, statements / commits / broker commands per event",
            {c: _counts_cell(r) for c, r in peer_runs.items() if "commits_per_event" in r})
    return rows


def _broker_counted(run: dict[str, Any]) -> bool:
    """Redis counts its commands; RabbitMQ keeps no count of its operations (the peer has no broker: 0)."""
    return run.get("broker", "redis") == "redis"


def _counts_cell(run: dict[str, Any]) -> str:
    broker = f"{run.get('redis_commands_per_event', 0.0):.1f}" if _broker_counted(run) else "not counted"
    return f"{run['statements_per_event']:.1f} / {run['commits_per_event']:.2f} / {broker}"


def steady_side_by_side(result: dict[str, Any], *, markdown: bool = False) -> str:
    rows = steady_side_by_side_rows(result)
    if not markdown:
        return table(rows, _cells(rows))
    cells = _cells(rows)
    out = ["| " + " | ".join(h for _, h, _ in cells) + " |",
           "|---|" + "|".join("---:" for _ in cells[1:]) + "|"]
    out += ["| " + " | ".join(r[k] for k, _, _ in cells) + " |" for r in rows]
    return "\n".join(out)


# Rows of the before/after tables: (figure, value of a run, format).
STEADY_FIGURES = [("ack req/s", lambda r: r["ack_rps"], ".1f"), ("ack p50 ms", lambda r: r["ack_p50_ms"], ".1f"),
                  ("ack p99 ms", lambda r: r["ack_p99_ms"], ".1f"),
                  ("end-to-end events/s", lambda r: r["e2e_eps"], ".1f"),
                  ("backlog at the last ack", lambda r: r["backlog_at_last_ack"], ".0f")]
STEADY_CPU_FIGURES = [(g, (lambda g: lambda r: group_cpu(r, g))(g), ".2f") for g in STEADY_CPU_GROUPS] + [
    ("total", lambda r: r["cpu_ms_total"], ".2f"),
    ("client: wrk (not in the total)", lambda r: r["client_cpu_ms"]["wrk"], ".2f")]


STEADY_TRAFFIC_FIGURES = [
    ("SQL statements", lambda r: r.get("statements_per_event", 0.0), ".2f"),
    ("round trips to Postgres", lambda r: r.get("round_trips_per_event", 0.0), ".2f"),
    ("Redis commands", lambda r: r.get("redis_commands_per_event", 0.0), ".2f")]


def steady_top_statements(run: dict[str, Any], count: int = 6) -> list[dict[str, str]]:
    """The statements Postgres spent most execution time on, per processed event."""
    calls = run.get("statements_by_name", {})
    return [{"statement": statement_label(name), "calls/event": f"{calls.get(name, 0.0):.2f}",
             "exec ms/event": f"{ms:.3f}"}
            for name, ms in list(run.get("exec_ms_by_name", {}).items())[:count]]


def _target_note(figure: str, c: int, new: float, ratio: float | None) -> tuple[str, str]:
    """(note after the current value, note after the ratio) where a target applies."""
    if figure == "ack p99 ms" and c == STEADY_P99_LEVEL:
        return f" (target ≤ {STEADY_P99_TARGET_MS:.0f}: {_met(new <= STEADY_P99_TARGET_MS)})", ""
    if figure == "end-to-end events/s" and c in STEADY_E2E_RATIO_LEVELS and ratio is not None:
        return "", f" (target ≥ {STEADY_E2E_RATIO_TARGET:.0f}×: {_met(ratio >= STEADY_E2E_RATIO_TARGET)})"
    if figure == "total":
        return f" (target ≤ {STEADY_CPU_TARGET_MS}: {_met(new <= STEADY_CPU_TARGET_MS)})", ""
    return "", ""


def steady_compare_rows(result: dict[str, Any], figures) -> list[dict[str, str]]:
    """Per figure: each level's compared value, current value and ratio current/compared."""
    current, baseline = steady_sides(result)
    runs, base = _by_level(current), _by_level(baseline)
    old, new = baseline["label"], current["label"]
    rows = []
    for figure, value, spec in figures:
        row = {"figure": figure}
        for c in runs:
            if c not in base:
                continue
            a, b = value(base[c]), value(runs[c])
            ratio = b / a if a else None
            note_new, note_ratio = _target_note(figure, c, b, ratio)
            row[f"c={c} {old}"] = format(a, spec)
            row[f"c={c} {new}"] = format(b, spec) + note_new
            row[f"c={c} ratio"] = ("-" if ratio is None else f"{ratio:.2f}") + note_ratio
        rows.append(row)
    return rows


def steady_compare_table(result: dict[str, Any], figures, *, markdown: bool = False) -> str:
    rows = steady_compare_rows(result, figures)
    return (md_table if markdown else table)(rows, _cells(rows))


# Stripe's own answer time for a retrieve, from the fake's ~1 ms to a slow real one: what the fetch
# costs a worker process that waits for it (a prefork pool child handles one task at a time).
STRIPE_LATENCIES_S = (0.1, 0.4)


def steady_payload_runs(result: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """The current revision's levels by payload ("snapshot", "thin"), each by concurrency."""
    current, _ = steady_sides(result)
    by_payload = current.get("payload_runs") or {result.get("payloads", ["snapshot"])[0]: current["runs"]}
    return {kind: {r["concurrency"]: r for r in runs} for kind, runs in by_payload.items()}


def steady_payload_rows(result: dict[str, Any]) -> list[dict[str, str]]:
    """Per level, a snapshot row and a thin row (the thin row with thin/snapshot ratios)."""
    runs = steady_payload_runs(result)
    snapshot, thin = runs.get("snapshot", {}), runs.get("thin", {})
    rows = []
    for c in result["levels"]:
        for kind, run in (("snapshot", snapshot.get(c)), ("thin", thin.get(c))):
            if run is None:
                continue
            base = snapshot.get(c) if kind == "thin" else None
            ratio = lambda f: f" ({f(run) / f(base):.2f}×)" if base and f(base) else ""  # noqa: E731
            api = run.get("stripe_api")
            rows.append({
                "c": str(c), "payload": kind, "ack req/s": f"{run['ack_rps']:.1f}",
                "ack p50 ms": f"{run['ack_p50_ms']:.1f}", "ack p99 ms": f"{run['ack_p99_ms']:.1f}",
                "end-to-end events/s": f"{run['e2e_eps']:.1f}" + ratio(lambda r: r["e2e_eps"]),
                "backlog at last ack": str(run["backlog_at_last_ack"]),
                "longest wait s": f"{run['max_wait_s']:.1f}",
                "receiver": f"{run['cpu_ms'].get('receiver', 0.0):.2f}",
                "workers (parents + children)": f"{run['cpu_ms'].get('worker parents', 0.0) + run['cpu_ms'].get('worker pool children', 0.0):.2f}",
                "Postgres": f"{run['cpu_ms'].get('Postgres', 0.0):.2f}",
                "CPU total": f"{run['cpu_ms_total']:.2f}" + ratio(lambda r: r["cpu_ms_total"]),
                "Stripe API requests/event": f"{api['per_event']:.2f}" if api else "-",
                "fake Stripe API CPU": f"{run['client_cpu_ms']['fake Stripe API']:.2f}" if api else "-",
                "errors": str(run["errors"])})
    return rows


def steady_payload_table(result: dict[str, Any], *, markdown: bool = False) -> str:
    rows = steady_payload_rows(result)
    return (md_table if markdown else table)(rows, _cells(rows))


def thin_fetch_lines(result: dict[str, Any]) -> list[str]:
    """What each thin level's rate would need against Stripe instead of the fake: pool processes
    waiting on fetches = events/s × requests/event × answer time (Little's law)."""
    pool = result.get("workers", 2) * result.get("worker_concurrency", 2)
    out = []
    for c, run in steady_payload_runs(result).get("thin", {}).items():
        per_event = run["stripe_api"]["per_event"]
        lo, hi = STRIPE_LATENCIES_S
        out.append(f"c={c}: {run['e2e_eps']:.1f} events/s × {per_event:.2f} requests/event needs "
                   f"{run['e2e_eps'] * per_event * lo:.0f} ({1000 * lo:.0f} ms answers) to "
                   f"{run['e2e_eps'] * per_event * hi:.0f} ({1000 * hi:.0f} ms) pool processes waiting on Stripe "
                   f"at once; the stack's {pool} would hold it to {pool / (per_event * lo):.1f} to "
                   f"{pool / (per_event * hi):.1f} events/s")
    return out


def _per_event_counts(run: dict[str, Any]) -> dict[str, str]:
    """What a level paid per event beside CPU (a run recorded before these were counted has none)."""
    counts = {"statements/event": "statements_per_event", "round trips/event": "round_trips_per_event",
              "commits/event": "commits_per_event", "WAL KB/event": "wal_kb_per_event",
              "broker commands/event": "redis_commands_per_event"}
    if not _broker_counted(run):
        del counts["broker commands/event"]
    return {label: f"{run[key]:.2f}" for label, key in counts.items() if key in run}


def steady_peer_rows(result: dict[str, Any]) -> list[dict[str, str]]:
    """The sync engine's levels: acknowledged (and so applied) deliveries, CPU ms per event."""
    rows = []
    for c, r in steady_peer(result).items():
        rows.append({"c": str(c), "ack req/s": f"{r['ack_rps']:.1f}", "ack p50 ms": f"{r['ack_p50_ms']:.1f}",
                     "ack p99 ms": f"{r['ack_p99_ms']:.1f}", "acknowledged and applied events/s": f"{r['e2e_eps']:.1f}",
                     "seconds": f"{r['e2e_s']:.1f}", "objects missing": str(r["objects_missing"]),
                     "Stripe API calls": str(r["stripe_api_requests"]), "deadlocks": str(r["deadlocks"]),
                     "machine busy %": f"{100 * r['busy']:.0f}",
                     **{k: f"{v:.2f}" for k, v in r["cpu_ms"].items()}, "total": f"{r['cpu_ms_total']:.2f}",
                     **_per_event_counts(r),
                     "client: wrk": f"{r['client_cpu_ms']['wrk']:.2f}", "errors": str(r["errors"])})
    return rows


def steady_peer_table(result: dict[str, Any], *, markdown: bool = False) -> str:
    rows = steady_peer_rows(result)
    return (md_table if markdown else table)(rows, _cells(rows))


# What the business writes may cost, CPU ms per processed event at every level: the current revision's
# total minus the floor's (--floor), the two measured in turns in the same run.
BUSINESS_WRITES_TARGET_MS = 0.4


def business_writes(result: dict[str, Any]) -> dict[str, Any]:
    """Per broker and level, the current revision's cost per event, the floor's, and the difference:
    what the handlers' writes cost, since the floor runs everything else (empty without --floor)."""
    out: dict[str, Any] = {"floor": None, "target_ms": BUSINESS_WRITES_TARGET_MS, "brokers": {}}
    for broker in steady_brokers(result):
        floor = steady_floor(result, broker)
        if floor is None:
            continue
        out["floor"] = floor["label"]
        base = _by_level(floor)
        rows = []
        for c, run in _by_level(steady_sides(result, broker)[0]).items():
            if c not in base:
                continue
            f = base[c]
            total = run["cpu_ms_total"] - f["cpu_ms_total"]
            rows.append({"concurrency": c, "cpu_ms_total": total,
                         "cpu_ms": {g: group_cpu(run, g) - group_cpu(f, g) for g in STEADY_CPU_GROUPS},
                         "current_cpu_ms_total": run["cpu_ms_total"], "floor_cpu_ms_total": f["cpu_ms_total"],
                         "current_statements_per_event": run["statements_per_event"],
                         "floor_statements_per_event": f["statements_per_event"],
                         "statements_per_event": run["statements_per_event"] - f["statements_per_event"],
                         "met": total <= BUSINESS_WRITES_TARGET_MS})
        out["brokers"][broker] = rows
    return out


def business_writes_table(rows: list[dict[str, Any]], *, markdown: bool = False) -> str:
    cells = [{"c": str(r["concurrency"]), "current CPU": f"{r['current_cpu_ms_total']:.2f}",
              "floor CPU": f"{r['floor_cpu_ms_total']:.2f}",
              "business writes CPU": f"{r['cpu_ms_total']:.2f} (target ≤ {BUSINESS_WRITES_TARGET_MS}: "
                                     f"{_met(r['met'])})",
              **{g: f"{v:.2f}" for g, v in r["cpu_ms"].items()},
              "statements/event current": f"{r['current_statements_per_event']:.2f}",
              "floor": f"{r['floor_statements_per_event']:.2f}",
              "difference": f"{r['statements_per_event']:.2f}"} for r in rows]
    return (md_table if markdown else table)(cells, _cells(cells))


def steady_summary(result: dict[str, Any]) -> tuple[str, str]:
    on = steady_brokers(result)
    first = on[0]
    peer_runs = steady_peer(result)
    current, baseline = steady_sides(result)
    base = _by_level(baseline)
    parts = []
    values: dict[str, Any] = {}
    if peer_runs or len(on) > 1:
        parts.append("side by side" + (f" with {result['peer']['package']} (the same stream, the same run)"
                                       if peer_runs else "") + f"\n{steady_side_by_side(result)}")
    for broker in on:
        name = BROKER_LABELS.get(broker, broker)
        prefix = "" if broker == first else f"{broker}_"
        mine, _ = steady_sides(result, broker)
        parts.append(f"current revision on {name} (CPU columns: ms per processed event; the client's apart)\n"
                     f"{steady_table(result, broker=broker)}")
        for r in mine["runs"]:
            c = r["concurrency"]
            values.update({f"{prefix}ack_rps_c{c}": r["ack_rps"], f"{prefix}ack_p50_ms_c{c}": r["ack_p50_ms"],
                           f"{prefix}ack_p99_ms_c{c}": r["ack_p99_ms"], f"{prefix}e2e_eps_c{c}": r["e2e_eps"],
                           f"{prefix}cpu_ms_c{c}": r["cpu_ms_total"]})
            if broker == first:
                values.update({f"cpu_ms_{g.replace(' ', '_')}_c{c}": group_cpu(r, g) for g in STEADY_CPU_GROUPS})
                values[f"wrk_cpu_ms_c{c}"] = r["client_cpu_ms"]["wrk"]
            if "deadlocks" in r:
                values[f"{prefix}deadlocks_c{c}"] = r["deadlocks"]
            ratio = peer_ratio(r, peer_runs.get(c))
            if ratio is not None:
                values[f"{prefix}e2e_vs_peer_c{c}"] = ratio
    if peer_runs:
        parts.append(f"{result['peer']['package']} on Node {result['peer'].get('node', '?')}, the same stream "
                     f"(acknowledged means applied; CPU: ms per event)\n{steady_peer_table(result)}")
        for c, r in peer_runs.items():
            values.update({f"peer_e2e_eps_c{c}": r["e2e_eps"], f"peer_ack_p99_ms_c{c}": r["ack_p99_ms"],
                           f"peer_cpu_ms_c{c}": r["cpu_ms_total"]})
    top = current["runs"][-1]
    rows = steady_top_statements(top)
    if rows:
        parts.append(f"Postgres' execution time per processed event, current revision at c={top['concurrency']} "
                     f"({top.get('statements_per_event', 0):.2f} statements, {top.get('round_trips_per_event', 0):.2f} "
                     f"round trips and {top.get('redis_commands_per_event', 0):.2f} Redis commands per event)\n"
                     + table(rows, _cells(rows)))
    if baseline:
        parts.append(f"{baseline['label']} (the compared revision)\n"
                     f"{steady_table(result, label=baseline['label'])}")
        parts.append(f"before/after (ratio = current / {baseline['label']}; the last three per processed event)\n"
                     f"{steady_compare_table(result, STEADY_FIGURES + STEADY_CPU_FIGURES + STEADY_TRAFFIC_FIGURES)}")
        values["compared"] = baseline["label"]
        for r in current["runs"]:
            c = r["concurrency"]
            if c in base:
                values[f"e2e_ratio_c{c}"] = steady_e2e_ratio(r, base[c])
                values[f"cpu_ratio_c{c}"] = r["cpu_ms_total"] / base[c]["cpu_ms_total"] if base[c]["cpu_ms_total"] else 0
    writes = business_writes(result)
    if writes["floor"]:
        floor = writes["floor"]
        values["floor"] = floor
        for broker, rows in writes["brokers"].items():
            name = BROKER_LABELS.get(broker, broker)
            prefix = "" if broker == first else f"{broker}_"
            parts.append(f"{floor} (the floor: this commit's product with one handler, which writes nothing) "
                         f"on {name}\n{steady_table(result, label=floor, broker=broker)}")
            parts.append(f"business writes (current − {floor}, same run) on {name}: CPU ms per processed event, "
                         f"in all and per process type; statements per event\n{business_writes_table(rows)}\n"
                         f"target: business writes ≤ {BUSINESS_WRITES_TARGET_MS} ms CPU per event at every level: "
                         + ", ".join(f"c={r['concurrency']}: {r['cpu_ms_total']:.2f}" for r in rows)
                         + f" -> {_met(bool(rows) and all(r['met'] for r in rows))}")
            for r in rows:
                c = r["concurrency"]
                values.update({f"{prefix}business_cpu_ms_c{c}": r["cpu_ms_total"],
                               f"{prefix}floor_cpu_ms_c{c}": r["floor_cpu_ms_total"],
                               f"{prefix}statements_c{c}": r["current_statements_per_event"],
                               f"{prefix}floor_statements_c{c}": r["floor_statements_per_event"]})
                if broker == first:
                    values.update({f"business_cpu_ms_{g.replace(' ', '_')}_c{c}": v for g, v in r["cpu_ms"].items()})
            values[f"{prefix}business_writes_{str(BUSINESS_WRITES_TARGET_MS).replace('.', '_')}ms"] = (
                "met" if rows and all(r["met"] for r in rows) else "not_met")
    payload_runs = steady_payload_runs(result)
    if "thin" in payload_runs:
        if "snapshot" in payload_runs:
            parts.append("thin notifications next to snapshot events (current revision; CPU: ms per processed "
                         "event; ratio thin/snapshot)\n" + steady_payload_table(result))
        parts.append("thin levels against Stripe's answer times instead of the fake's (~1 ms):\n"
                     + "\n".join(f"  {line}" for line in thin_fetch_lines(result)))
        values["payload"] = "+".join(payload_runs)
        snapshot = payload_runs.get("snapshot", {})
        for c, r in payload_runs["thin"].items():
            values.update({f"thin_e2e_eps_c{c}": r["e2e_eps"], f"thin_ack_p50_ms_c{c}": r["ack_p50_ms"],
                           f"thin_ack_p99_ms_c{c}": r["ack_p99_ms"], f"thin_cpu_ms_c{c}": r["cpu_ms_total"],
                           f"thin_api_requests_per_event_c{c}": r["stripe_api"]["per_event"],
                           f"thin_fake_api_cpu_ms_c{c}": r["client_cpu_ms"]["fake Stripe API"]})
            if c in snapshot and snapshot[c]["e2e_eps"] and snapshot[c]["cpu_ms_total"]:
                values[f"thin_e2e_ratio_c{c}"] = r["e2e_eps"] / snapshot[c]["e2e_eps"]
                values[f"thin_cpu_ratio_c{c}"] = r["cpu_ms_total"] / snapshot[c]["cpu_ms_total"]
    targets = steady_targets(result)
    parts.append("targets of the earlier passes:\n"
                 + "\n".join(f"  {t}: {what} -> {_met(ok)}" for t, what, ok in targets.values()))
    values["errors"] = sum(r["errors"] for broker in on for side in steady_revisions(result, broker)
                           for runs in (side.get("payload_runs") or {"": side["runs"]}).values() for r in runs)
    if peer_runs:
        values["peer_errors"] = sum(r["errors"] for r in peer_runs.values())
    values.update({key: "met" if ok else "not_met" for key, (_, _, ok) in targets.items()})
    return "\n\n".join(parts), kv("steady", values)


# -- --compare, any scenario ----------------------------------------------------------------------

def parse_summary(line: str) -> dict[str, str]:
    """The key=value pairs of a SUMMARY line."""
    return dict(part.split("=", 1) for part in line.split()[2:] if "=" in part)


def compare_table(current_line: str, baseline_line: str, baseline_label: str) -> str:
    """Every numeric figure of two SUMMARY lines of one scenario, side by side, with current / compared."""
    new, old = parse_summary(current_line), parse_summary(baseline_line)
    rows = []
    for key, value in new.items():
        try:
            b, a = float(value), float(old[key])
        except (KeyError, ValueError):
            continue
        rows.append({"figure": key, baseline_label: old[key], "current": value,
                     "ratio": f"{b / a:.3f}" if a else "-"})
    return table(rows, _cells(rows)) if rows else "(no figure in common)"


def summary(name: str, result: dict[str, Any]) -> tuple[str, str]:
    """(table, summary line) for one scenario's result."""
    if name == "ingest":
        values = {}
        for r in result["levels"]:
            c = r["concurrency"]
            values.update({f"rps_c{c}": r["rps"], f"p50_ms_c{c}": r["p50_ms"], f"p95_ms_c{c}": r["p95_ms"],
                           f"p99_ms_c{c}": r["p99_ms"], f"pgbench_tps_c{c}": r["pgbench_tps"],
                           f"ingest_ratio_c{c}": r["ingest_ratio"]})
        values["errors"] = sum(r["errors"] for r in result["levels"])
        values["loadgen"] = "wrk"
        return table(result["levels"], INGEST_COLUMNS), kv("ingest", values)
    if name == "drain":
        values = {}
        first = result.get("broker", "redis")
        for fleet, per_broker in drain_fleets(result).items():
            key = "readme" if not fleet.isdigit() else f"w{fleet}"
            for broker, r in per_broker.items():
                prefix = "" if broker == first else f"{broker}_"
                values.update({f"{prefix}events_per_s_{key}": r["events_per_s"]})
                if "busy" in r:
                    values.update({f"{prefix}busy_{key}": r["busy"], f"{prefix}stack_busy_{key}": r["stack_busy"],
                                   f"{prefix}deadlocks_{key}": r["deadlocks"]})
                if broker == first:
                    values.update({f"pgbench_tps_{key}": r["pgbench_tps"], f"drain_ratio_{key}": r["drain_ratio"]})
        for fleet, x in drain_broker_ratios(result).items():
            values[f"redis_vs_amqp_{'readme' if not fleet.isdigit() else 'w' + fleet}"] = x["ratio"]
        values["errors"] = sum(r["errors"] for r in drain_rows(result))
        text = table(drain_rows(result), DRAIN_COLUMNS)
        lines = drain_ratio_lines(result)
        if lines:
            text += "\nRedis / RabbitMQ, same fleet, same backlog:\n" + "\n".join(f"  {line}" for line in lines)
        return text, kv("drain", values)
    if name == "burst":
        text = table(result["segments"], BURST_COLUMNS) + (
            f"\nack all {result['deliveries']} deliveries: {result['ack_all_s']:.1f}s "
            f"({result['ack_rps']:.0f}/s) | all processed: {result['processed_all_s']:.1f}s | "
            f"peak oldest unprocessed: {result['peak_oldest_unprocessed_s']:.1f}s | peak backlog "
            f"{result['peak_backlog']} | sent again (never left wrk): {result.get('resent', 0)}\nack latency vs backlog: corr(backlog, p50)={result['corr_backlog_p50']:+.2f} "
            f"corr(backlog, p99)={result['corr_backlog_p99']:+.2f}; p50 at the lower/higher half of the "
            f"backlog {result['p50_ms_low_backlog']:.1f}/{result['p50_ms_high_backlog']:.1f} ms, p99 "
            f"{result['p99_ms_low_backlog']:.1f}/{result['p99_ms_high_backlog']:.1f} ms")
        ctl = result.get("control")
        if ctl:
            text += (f"\ncontrol, no worker running: backlog 0 -> {ctl['no_backlog']['rps']:.0f} req/s, p50 "
                     f"{ctl['no_backlog']['p50_ms']:.1f} ms, p99 {ctl['no_backlog']['p99_ms']:.1f} ms; backlog "
                     f"{ctl['backlog']['backlog']:,} -> {ctl['backlog']['rps']:.0f} req/s, p50 "
                     f"{ctl['backlog']['p50_ms']:.1f} ms, p99 {ctl['backlog']['p99_ms']:.1f} ms "
                     f"(req/s ratio {ctl['rps_ratio']:.2f}, p99 ratio {ctl['p99_ratio']:.2f})")
        values = {k: result[k] for k in ("deliveries", "ack_all_s", "processed_all_s",
                                         "peak_oldest_unprocessed_s", "peak_backlog", "corr_backlog_p50",
                                         "corr_backlog_p99", "p99_ms_low_backlog", "p99_ms_high_backlog",
                                         "errors", "resent")}
        if ctl:
            values.update({"control_rps_backlog0": ctl["no_backlog"]["rps"],
                           "control_rps_backlog_full": ctl["backlog"]["rps"],
                           "control_p99_ms_backlog0": ctl["no_backlog"]["p99_ms"],
                           "control_p99_ms_backlog_full": ctl["backlog"]["p99_ms"],
                           "control_rps_ratio": ctl["rps_ratio"],
                           "ack_rps_vs_no_workers": burst_ack_ratio(result),
                           "ack_within_10pct": "met" if burst_ack_target(result) else "not_met"})
        values["worker_nice"] = result.get("worker_nice", 0)
        if "deadlocks" in result:
            text += (f"\ndeadlocks detected (pg_stat_database): {result['deadlocks']}; attempts failed on one "
                     f"(ledger.attempts): {result['attempts_deadlocked']}; worker log lines naming one: "
                     f"{result['log_deadlocks']}")
            values.update({k: result[k] for k in ("deadlocks", "attempts_deadlocked", "log_deadlocks")})
        return text, kv("burst", values)
    if name == "replay":
        rows = [{"run": "live ingest alone", "rps": result["live_rps_alone"], "p50": result["live_p50_ms_alone"],
                 "p99": result["live_p99_ms_alone"]},
                {"run": "live ingest during replay", "rps": result["live_rps_during"],
                 "p50": result["live_p50_ms_during"], "p99": result["live_p99_ms_during"]}]
        text = table(rows, [("run", "c=8", ""), ("rps", "req/s", ".1f"), ("p50", "p50 ms", ".1f"),
                            ("p99", "p99 ms", ".1f")])
        text += (f"\nreplayed {result['replayed']}/{result['events']} in {result['seconds']:.1f}s = "
                 f"{result['events_per_s']:.0f} events/s ({result['rate_option']})")
        values = {k: result[k] for k in ("replayed", "events_per_s", "live_rps_alone", "live_rps_during",
                                         "live_slowdown", "live_p99_ms_alone", "live_p99_ms_during")}
        values["errors"] = result["live_errors"] + (result["events"] - result["replayed"])
        return text, kv("replay", values)
    if name == "scale":
        rows = []
        for c, r in result["ingest_ratio"].items():
            rows.append({"figure": f"ingest req/s c={c}", "ratio": r["rps"], "pgbench": r["pgbench"]})
        for c, r in result["ingest_ratio"].items():
            rows.append({"figure": f"ingest p99 c={c} (empty/1M)", "ratio": r["p99"], "pgbench": None})
        for w, r in result["drain_ratio"].items():
            rows.append({"figure": f"drain events/s workers={w}", "ratio": r["events_per_s"],
                         "pgbench": r["pgbench"]})
        rows.append({"figure": "sweep query time (empty/1M)", "ratio": result["sweep_ratio"]["query"],
                     "pgbench": None})
        rows.append({"figure": "sweep pass time (empty/1M)", "ratio": result["sweep_ratio"]["pass"],
                     "pgbench": None})
        h = result["history"]
        text = table(rows, [("figure", "figure", ""), ("ratio", "1M / empty", ".3f"),
                            ("pgbench", "pgbench 1M / empty", ".3f")])
        text += (f"\nhistory: {h['events']:,} processed events, database {h['database_mb']:.0f} MB, written in "
                 f"{h['total_s']:.0f}s\nsweep query plan with the history:\n" + result["sweep"]["plan"])
        values = {f"ingest_rps_ratio_c{c}": r["rps"] for c, r in result["ingest_ratio"].items()}
        values.update({f"drain_ratio_w{w}": r["events_per_s"] for w, r in result["drain_ratio"].items()})
        values.update({"sweep_query_ratio": result["sweep_ratio"]["query"],
                       "sweep_pass_ratio": result["sweep_ratio"]["pass"],
                       "sweep_query_ms_1m": result["sweep"]["query_ms_median"],
                       "sweep_partial_index_only": sweep_uses_partial(result["sweep"]),
                       "min_ratio": min(scale_figures(result).values()),
                       "below_0_9": ",".join(k.replace(" ", "_") for k, v in scale_figures(result).items() if v < 0.9)
                       or "none",
                       "target_0_9": "met" if min(scale_figures(result).values()) >= 0.9 else "not_met"})
        return text, kv("scale", values)
    if name == "cost":
        rc, wk = result["receiver"], result["worker"]
        rows = [
            {"per event": "SQL statements", "receiver": rc["statements_per_event"], "worker": wk["statements_per_event"]},
            {"per event": "round trips to Postgres", "receiver": rc["round_trips_per_event"],
             "worker": wk["round_trips_per_event"]},
            {"per event": "writes to Postgres", "receiver": rc.get("client_writes_per_event"),
             "worker": wk.get("client_writes_per_event")},
            {"per event": "transactions", "receiver": rc["transactions_per_event"], "worker": wk["transactions_per_event"]},
            {"per event": "Redis commands", "receiver": rc["redis_commands_per_event"],
             "worker": wk["redis_commands_per_event"]},
            {"per event": "process CPU ms", "receiver": sum(rc["cpu_ms_per_event"].values()),
             "worker": sum(wk["cpu_ms_per_event"].values())},
            {"per event": "Postgres CPU ms", "receiver": rc["postgres_cpu_ms_per_event"],
             "worker": wk["postgres_cpu_ms_per_event"]},
        ]
        text = table(rows, [("per event", "per event", ""), ("receiver", "receiver", ".2f"),
                            ("worker", "worker", ".2f")])
        text += "\nstatements per event: receiver " + ", ".join(
            f"{statement_label(k)} {v:.2f}" for k, v in rc["statements_by_name"].items()) + "\n                      worker " + \
            ", ".join(f"{statement_label(k)} {v:.2f}" for k, v in wk["statements_by_name"].items())
        text += "\npeak RSS MB: " + ", ".join(f"{k} {v:.0f}" for k, v in result["peak_rss_mb"].items())
        values = {"receiver_statements": rc["statements_per_event"], "receiver_transactions": rc["transactions_per_event"],
                  "receiver_redis_cmds": rc["redis_commands_per_event"],
                  "receiver_cpu_ms": sum(rc["cpu_ms_per_event"].values()),
                  "worker_statements": wk["statements_per_event"], "worker_round_trips": wk["round_trips_per_event"],
                  "worker_transactions": wk["transactions_per_event"],
                  "worker_redis_cmds": wk["redis_commands_per_event"],
                  "worker_cpu_ms": sum(wk["cpu_ms_per_event"].values()),
                  "postgres_cpu_ms_receiver": rc["postgres_cpu_ms_per_event"],
                  "postgres_cpu_ms_worker": wk["postgres_cpu_ms_per_event"],
                  "worker_2tx_4rt": "met" if worker_round_trip_target(wk) else "not_met"}
        for k, v in result["peak_rss_mb"].items():
            values["peak_rss_mb_" + k.replace(" ", "_")] = v
        values["rss_under_150mb"] = "met" if result["rss_target_met"] else "not_met"
        return text, kv("cost", values)
    if name == "steady":
        return steady_summary(result)
    if name == "receiver-cost":
        return receiver_cost_summary(result)
    if name == "rescue":
        from .rescue import summary as rescue_summary

        text, values = rescue_summary(result)
        return text, kv("rescue", values)
    if name == "retention":
        from .retention import summary as retention_summary

        text, values = retention_summary(result)
        return text, kv("retention", values)
    if name == "reproject":
        from .reproject import summary as reproject_summary

        text, values = reproject_summary(result)
        return text, kv("reproject", values)
    if name == "profile":
        parts = []
        for who in ("receiver", "worker"):
            parts.append(f"{who}: top frames by inclusive share of samples")
            parts.append(table(result[who]["profile"]["inclusive"][:25],
                               [("share", "incl %", ".1f"), ("frame", "frame", "")]))
            parts.append(f"{who}: top frames by own share of samples")
            parts.append(table(result[who]["profile"]["self"][:12], [("share", "self %", ".1f"), ("frame", "frame", "")]))
        return "\n".join(parts), kv("profile", {"receiver_samples": result["receiver"]["profile"]["samples"],
                                                "worker_samples": result["worker"]["profile"]["samples"],
                                                "receiver_rps": result["receiver"]["rps"]})
    raise KeyError(name)


# -- receiver-cost --------------------------------------------------------------------------------

RECEIVER_COST_COLUMNS = [("server", "server", ""), ("requests", "deliveries", ""), ("rps", "req/s", ".1f"),
                         ("p99_ms", "p99 ms", ".1f"), ("cpu_ms_per_request", "server CPU ms/request", ".3f"),
                         ("postgres_cpu_ms_per_request", "Postgres CPU ms/request", ".3f"),
                         ("redis_cpu_ms_per_request", "Redis CPU ms/request", ".3f"), ("errors", "errors", "")]


def receiver_cost_met(result: dict[str, Any]) -> bool:
    return result["ratio"] <= result.get("target", RECEIVER_COST_TARGET)


def receiver_cost_summary(result: dict[str, Any]) -> tuple[str, str]:
    rows = [{**result["receiver"], "server": "receiver (all runs)"},
            {**result["minimal"], "server": "minimal WSGI (all runs)"}] if result["rounds"] > 1 else []
    text = (table(result["runs"] + rows, RECEIVER_COST_COLUMNS)
            + f"\nboth under {result['server']}, wrk at c={result['connections']}, {result['requests_per_run']:,} new "
              f"deliveries per run, {result['rounds']} run(s) each, taking turns\nreceiver CPU per request / minimal "
              f"WSGI app's: {result['ratio']:.2f}× (target ≤ {result.get('target', RECEIVER_COST_TARGET)}×: "
              f"{_met(receiver_cost_met(result))})")
    values = {"receiver_cpu_ms": result["receiver"]["cpu_ms_per_request"],
              "minimal_cpu_ms": result["minimal"]["cpu_ms_per_request"], "ratio": result["ratio"],
              "receiver_rps": result["receiver"]["rps"], "minimal_rps": result["minimal"]["rps"],
              "errors": result["receiver"]["errors"] + result["minimal"]["errors"],
              "within_1_3x": "met" if receiver_cost_met(result) else "not_met"}
    return text, kv("receiver-cost", values)


# -- the issue's targets, printed at the end of every run ------------------------------------------

def issue_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each steady target of issue 39 with what this run measured: ``met`` True/False, or None when the
    run did not measure it (the broker, the floor or the peer did not run)."""
    out: list[dict[str, Any]] = []
    steady = results.get("steady")
    peer_runs = steady_peer(steady) if steady else {}
    on = steady_brokers(steady) if steady else []
    redis = _by_level(steady_sides(steady, "redis")[0]) if "redis" in on else {}

    def add(key: str, target: str, measured: str, met: bool | None) -> None:
        out.append({"key": key, "target": target, "measured": measured, "met": met})

    levels = [c for c in PEER_E2E_RATIO_TARGETS if c in redis and c in peer_runs]
    ratios = {c: peer_ratio(redis[c], peer_runs[c]) or 0.0 for c in levels}
    add("e2e_vs_peer", "end-to-end events/s on Redis ≥ " + " and ".join(
        f"{v:.1f}× the sync engine's at c={c}" for c, v in PEER_E2E_RATIO_TARGETS.items()),
        ", ".join(f"c={c}: {redis[c]['e2e_eps']:.1f} vs {peer_runs[c]['e2e_eps']:.1f} = {v:.2f}×"
                  for c, v in ratios.items()) or "not measured: run steady on Redis with the peer",
        all(v >= PEER_E2E_RATIO_TARGETS[c] for c, v in ratios.items()) if ratios else None)

    writes = business_writes(steady).get("brokers", {}).get("redis", []) if steady else []
    add("business_writes", f"business writes' CPU (current − floor, same run) ≤ {BUSINESS_WRITES_TARGET_MS} ms "
        "per event at every level, on Redis",
        ", ".join(f"c={r['concurrency']}: {r['cpu_ms_total']:.2f} ms" for r in writes)
        or "not measured: run steady --floor", all(r["met"] for r in writes) if writes else None)

    run = redis.get(EVENT_STATEMENTS_LEVEL)
    add("statements", f"≤ {EVENT_STATEMENTS_TARGET} Postgres statements per event at c={EVENT_STATEMENTS_LEVEL}, "
        "on Redis", f"{run['statements_per_event']:.2f}" if run else "not measured: run steady on Redis",
        run["statements_per_event"] <= EVENT_STATEMENTS_TARGET if run else None)

    amqp = _by_level(steady_sides(steady, "amqp")[0]) if "amqp" in on else {}
    both = [c for c in amqp if c in redis and redis[c]["e2e_eps"]]
    add("amqp_vs_redis", f"end-to-end events/s on RabbitMQ ≥ {BROKER_RATIO_TARGET}× Redis' at every level",
        ", ".join(f"c={c}: {amqp[c]['e2e_eps']:.1f} vs {redis[c]['e2e_eps']:.1f} = "
                  f"{amqp[c]['e2e_eps'] / redis[c]['e2e_eps']:.2f}×" for c in both)
        or "not measured: run steady --broker both",
        all(amqp[c]["e2e_eps"] >= BROKER_RATIO_TARGET * redis[c]["e2e_eps"] for c in both) if both else None)

    counts = [(b, r["concurrency"], r["deadlocks"]) for b in on for r in steady_sides(steady, b)[0]["runs"]
              if "deadlocks" in r]
    add("no_deadlocks", "0 DeadlockDetected in the steady runs (pg_stat_database.deadlocks)",
        ", ".join(f"{BROKER_LABELS.get(b, b)} c={c}: {n}" for b, c, n in counts) or "not measured: run steady",
        all(n == 0 for *_, n in counts) if counts else None)
    return out


def _verdict(met: bool | None) -> str:
    return "-" if met is None else "PASS" if met else "FAIL"


def targets_table(targets: list[dict[str, Any]], *, markdown: bool = False) -> str:
    rows = [{"target": t["target"], "measured": t["measured"], "": _verdict(t["met"])} for t in targets]
    columns = [("target", "target", ""), ("measured", "measured", ""), ("", "", "")]
    if markdown:
        return md_table(rows, columns)
    return "\n".join(f"{_verdict(t['met']):>4}  {t['target']}\n      {t['measured']}" for t in targets)


def targets_summary(targets: list[dict[str, Any]]) -> str:
    return kv("targets", {t["key"]: _verdict(t["met"]) for t in targets})


# -- py-spy --------------------------------------------------------------------------------------

_FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:)]+)(?::\d+)?\)$")


def _frame(raw: str) -> str:
    m = _FRAME.match(raw.strip())
    if not m:
        return raw.strip()
    path = m["file"]
    for marker in ("site-packages/", "/work/main/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{m['func']} ({path})"


def collapse(paths: list[Path] | Path) -> dict[str, Any]:
    """Inclusive and self shares of a py-spy raw (collapsed) profile, frames without line numbers.

    Idle samples (waiting in accept/epoll/select, and a celery parent waiting on its
    pool) are dropped, so the shares are of time spent working (or waiting on a
    Postgres or Redis answer, which shows as socket reads).
    """
    inclusive: Counter = Counter()
    own: Counter = Counter()
    total = 0
    idle = ("select (", "poll (", "epoll", "accept (", "wait (selectors", "sleep (", "_wait_for_tstate_lock",
            "readinto (socket", "get (queue", "wait (threading")
    lines = []
    for path in ([paths] if isinstance(paths, Path) else paths):
        try:
            lines += path.read_text(errors="replace").splitlines()
        except OSError:
            pass
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or not stack:
            continue
        frames = [f for f in stack.split(";") if f]
        leaf = frames[-1] if frames else ""
        if any(marker in leaf for marker in idle) and not any("webhooks.py" in f or "processor.py" in f
                                                              for f in frames):
            continue
        n = int(count)
        total += n
        seen = set()
        for f in frames:
            name = _frame(f)
            if name not in seen:
                inclusive[name] += n
                seen.add(name)
        own[_frame(leaf)] += n
    def top(counter: Counter) -> list[dict[str, Any]]:
        return [{"frame": k, "share": 100.0 * v / total} for k, v in counter.most_common(60)] if total else []
    return {"samples": total, "inclusive": top(inclusive), "self": top(own)}


# -- plot and docs ---------------------------------------------------------------------------------

def _pyplot():
    """matplotlib's pyplot on the file-only backend, or None without the 'bench' extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(results: dict[str, Any], path: Path) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    ingest = results.get("ingest")
    drain = results.get("drain")
    scale = results.get("scale")
    panels = [p for p in (ingest, drain) if p]
    n = scale["history"]["events"] if scale else 0
    hist = (f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k") + " history"
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4))
    axes = axes if len(panels) > 1 else [axes]
    i = 0
    if ingest:
        ax = axes[i]
        i += 1
        cs = [r["concurrency"] for r in ingest["levels"]]
        ax.plot(cs, [r["pgbench_tps"] for r in ingest["levels"]], "s--", color="tab:gray",
                label="pgbench: same INSERT, empty ledger")
        ax.plot(cs, [r["rps"] for r in ingest["levels"]], "o-", color="tab:blue", label="receiver, empty ledger")
        if scale:
            ax.plot(cs, [r["pgbench_tps"] for r in scale["ingest"]["levels"]], "s:", color="tab:gray", alpha=0.6,
                    label=f"pgbench, {hist}")
            ax.plot(cs, [r["rps"] for r in scale["ingest"]["levels"]], "o:", color="tab:cyan",
                    label=f"receiver, {hist}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent deliveries (connections)")
        ax.set_ylabel("acknowledged deliveries / s")
        ax.set_title("Ingest vs the Postgres limit")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if drain:
        ax = axes[i]
        ws = [r["workers"] for r in drain["runs"]]
        ax.plot(ws, [r["pgbench_tps"] for r in drain["runs"]], "s--", color="tab:gray",
                label="pgbench: same SQL per event, empty ledger")
        ax.plot(ws, [r["events_per_s"] for r in drain["runs"]], "o-", color="tab:orange",
                label="workers, empty ledger")
        if scale:
            ax.plot(ws, [r["pgbench_tps"] for r in scale["drain"]["runs"]], "s:", color="tab:gray", alpha=0.6,
                    label=f"pgbench, {hist}")
            ax.plot(ws, [r["events_per_s"] for r in scale["drain"]["runs"]], "o:", color="tab:red",
                    label=f"workers, {hist}")
        ax.set_xticks(ws, [str(w) for w in ws])
        ax.set_xlabel("worker processes (pgbench clients)")
        ax.set_ylabel("processed events / s")
        ax.set_title("Drain of a 20,000-event backlog vs the Postgres limit"
                     if drain["events"] == 20000 else f"Drain of a {drain['events']:,}-event backlog")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_burst(burst: dict[str, Any], path: Path) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    timeline = burst.get("timeline") or []
    if not timeline:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12.4, 4.2))
    ts = [t for t, _, _ in timeline]
    ax1.plot(ts, [d for _, d, _ in timeline], color="tab:red", label="backlog (unprocessed events)")
    ax1b = ax1.twinx()
    ax1b.plot(ts, [a for _, _, a in timeline], color="tab:purple", alpha=0.6, label="oldest unprocessed age (s)")
    ax1.axvline(burst["ack_all_s"], color="tab:blue", ls="--", label="all acknowledged")
    ax1.set_xlabel("seconds since the burst started")
    ax1.set_ylabel("events")
    ax1b.set_ylabel("seconds")
    ax1.set_title(f"Burst of {burst['deliveries']:,} deliveries, 2 workers")
    lines = ax1.get_legend_handles_labels()
    lines2 = ax1b.get_legend_handles_labels()
    ax1.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper right")
    ax1.grid(alpha=0.3)
    segs = burst["segments"]
    mid = [(s["backlog_before"] + s["backlog_after"]) / 2 for s in segs]
    ax2.plot(mid, [s["p50_ms"] for s in segs], "o-", label="ack p50")
    ax2.plot(mid, [s["p99_ms"] for s in segs], "s-", label="ack p99")
    ax2.set_xlabel("backlog while the segment was sent (events)")
    ax2.set_ylabel("ack latency (ms)")
    ax2.set_ylim(bottom=0)
    ax2.set_title("Ack latency per 10% of the burst vs backlog")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    return _save(plt, fig, path)
