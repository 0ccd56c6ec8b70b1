"""steady: the whole stack as docs/configuration.md runs it, fed each level's stream at each concurrency until every
event is processed, beside Stripe's sync engine fed the same stream. Per level the same events serve every broker,
revision (--compare, this checkout) and payload in turn, so the machine's drift hits all alike."""
from __future__ import annotations

import contextlib
import json
import resource
import time
from typing import Any

from devkit.benchmarks import payloads, peer
from devkit.benchmarks.brokers import LABELS
from devkit.benchmarks.runner import (COUNTERS, QUEUE, SECRET, THIN_SECRET, Bench, Meter, log, run_stats, table,
                                      wait_processed, with_redeliveries)
from devkit.benchmarks.stack import MachineCpu, ProcessWatch, Stack
from devkit.benchmarks.workload import BacklogEvent
from devkit.procs import cpu_seconds
from devkit.sql import SQL
from devkit.stripe_api import DEFAULT_API_KEY, FakeStripe, FakeStripeProcess

INTERLEAVED = True
HEADLINE = ("e2e_eps_c8", "e2e_eps_c32", "e2e_vs_peer_c32", "ack_p99_ms_c32", "cpu_ms_c32", "errors")
STEADY_REDELIVERY_SHARE = 0.05  # of each level's deliveries: repeats of an event already sent
STEADY_PAYLOADS = {"snapshot": ("snapshot",), "thin": ("thin",), "both": ("snapshot", "thin")}
CPU_GROUPS = ("receiver", "worker parents", "worker pool children", "sweep", "Postgres", "broker")


def _steady_level(b: Bench, c: int, payload: str, events: list[BacklogEvent], warm_events: list) -> dict[str, Any]:
    """One level on the active side and broker: a fresh stack warmed up, on an empty ledger; then every delivery at
    ``c``, timed until every event is processed. "thin": the thin twins, fetched from a fake Stripe API of its own."""
    o, side, env, api = b.opts, b.side.label, b.env, None
    if payload == "thin":
        loads = [payloads.thin_load((json.loads(e.body) for e in evs), name_snapshot_twin=o.thin_snapshot_twin)
                 for evs in (warm_events, events)]
        (warm, unique), state = (b.signed_thin(load.notifications) for load in loads), FakeStripe(DEFAULT_API_KEY)
        for load in loads:
            state.put_objects(load.objects)
            for v2 in load.v2_events:
                state.add_v2_event(v2)
        (path := b.work / f"fake-stripe-{side}-c{c}-state.json").write_text(json.dumps(state.state()))
        api = FakeStripeProcess(b.work, state=path, latency_ms=o.thin_latency_ms)
    else:
        warm, unique = b.signed(warm_events), b.signed(events)
    deliveries, ids = with_redeliveries(unique, STEADY_REDELIVERY_SHARE, seed=c), [d.event_id for d in unique]
    b.stop_receiver()  # only this level's stack runs
    with b.started("fake Stripe API", api) if api else contextlib.nullcontext():
        if api is not None:
            env = {**env, "STRIPE_THIN_WEBHOOK_SECRET": THIN_SECRET, "STRIPE_API_KEY": api.api_key,
                   "STRIPE_API_BASE": api.base_url, **({"STRIPE_FETCH_CONCURRENCY": str(o.fetch_concurrency)}
                                                      if o.fetch_concurrency is not None else {})}
        tag = "" if payload == "snapshot" else f"{payload}-"
        stack = Stack(env, b.work, queue=QUEUE, label=f"steady-{tag}{side}-{b.broker}-c{c}-", checkout=b.checkout,
                      **{f"receiver_{k}": getattr(o, f"receiver_{k}") for k in ("server", "workers", "threads")})
        b.clear()
        with b.started("steady stack", stack):
            rc = stack.receiver
            b.wrk.run(rc.port, warm, 8, max_duration_s=60)  # warm-up: imports, pools, prepared statements
            wait_processed(b, rc, warm, timeout_s=120)
            b.clear()
            if api is not None:
                api.control.clear_requests()
            meter = Meter(b, lambda: {**stack.pids(), **b.broker_group()})
            processed = lambda: b.db.one(SQL.bench_events_processed_count, {"ids": ids})  # noqa: E731
            meter.begin_sql()
            stack.fleet.mark_logs()
            deadlocks0, commits0, monitor0 = b.deadlocks(), b.commits(), b.db.monitor_statements
            self0, fake0 = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), cpu_seconds(api.pid) if api else 0.0
            wal0 = b.db.one(SQL.bench_wal_lsn)
            meter.begin_cpu(processed)
            machine = MachineCpu().begin()
            r = b.wrk.run(rc.port, deliveries, c, max_duration_s=600)
            backlog = b.db.unfinished()
            resent = wait_processed(b, rc, unique, timeout_s=max(300, len(unique) / 10))
            busy = machine.end()
            meter.end_cpu(processed)
            wal_bytes = b.db.one(SQL.bench_wal_bytes_since, {"lsn": wal0})
            driver_s = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - self0  # user + system
            fake_s, fetches = (cpu_seconds(api.pid) - fake0, api.control.requests) if api else (0.0, None)
            cost, stats, attempts_deadlocked = meter.finish(None), run_stats(b, ids), b.attempts_deadlocked(ids)
            rss, log_deadlocks = ProcessWatch(stack.pids).peak_rss_mb(), stack.fleet.log_mentions("DeadlockDetected")
        b.wait_backends_gone("worker")
        # Counted once the backends exit (Postgres 15 publishes them late), less the bench's own polling.
        deadlocks, commits = b.deadlocks() - deadlocks0, b.commits() - commits0 - (b.db.monitor_statements - monitor0)
    cpu = {**meter.cpu, "Postgres": meter.pg_cpu}
    n, e2e_s = max(stats["processed"], 1), stats["last_processed"] - r.started_at
    row = {"concurrency": c, "payload": payload, "broker": b.broker, "deliveries": len(deliveries), "resent": resent,
           "events": len(unique), "redeliveries": len(deliveries) - len(unique), "processed": stats["processed"],
           "not_processed": stats["not_processed"], "errors": r.errors + stats["not_processed"], "ack_rps": r.rps,
           "ack_p50_ms": r.p50_ms, "ack_p99_ms": r.p99_ms, "ack_s": r.duration_s, "e2e_s": e2e_s,
           "e2e_eps": stats["processed"] / e2e_s if e2e_s > 0 else 0.0, "backlog_at_last_ack": backlog,
           "max_wait_s": stats["max_wait_s"], "cpu_ms": {k: 1000 * v / n for k, v in cpu.items()},
           "cpu_ms_total": 1000 * sum(cpu.values()) / n, "wrk_cpu_pct": r.wrk_cpu_pct, "peak_rss_mb": rss,
           "client_cpu_ms": {"wrk": 1000 * r.wrk_cpu_s / n, "bench driver": 1000 * driver_s / n}, "busy": busy["busy"],
           "iowait": busy["iowait"], "wal_kb_per_event": wal_bytes / 1024 / n, "commits_per_event": commits / n,
           "deadlocks": deadlocks, "attempts_deadlocked": attempts_deadlocked, "log_deadlocks": log_deadlocks,
           **{k: cost[k] for k in ("statements_per_event", "round_trips_per_event", "statements_by_name",
                                   "exec_ms_by_name", "redis_commands_per_event", "redis_by_command")}}
    if fetches is not None:  # the fake stands in for Stripe: its CPU is the client's, like wrk's
        row["client_cpu_ms"]["fake Stripe API"] = 1000 * fake_s / n
        v2, objects = (sum(q.path.startswith(p) for q in fetches) for p in ("/v2/core/events/", "/v1/"))
        row["stripe_api"] = {"requests": len(fetches), "v2_events": v2, "objects": objects,
                             "failed": sum((q.status or 0) >= 400 for q in fetches), "per_event": len(fetches) / n,
                             "v2_events_per_event": v2 / n, "objects_per_event": objects / n}
    log(f"  steady [{side}, {b.broker_label}, {payload}] c={c}: {row['e2e_eps']:.1f} events/s, errors {row['errors']}")
    b.clear()
    return row


def _peer_level(b: Bench, c: int, events: list[BacklogEvent], warm_events: list[BacklogEvent]) -> dict[str, Any]:
    """The sync engine on the same stream, warmed up the same, emptied. It applies each event before answering: its
    events/s runs to the last answer (or last row written, if later), each event's object checked present after."""
    spec = b.work / f"sync-engine-openapi-c{c}.json"
    spec.write_text(json.dumps(peer.openapi_document(json.loads(e.body) for e in [*warm_events, *events])))
    database, api = peer.SyncEngineDatabase(b.pg.url_for).create(), FakeStripeProcess(b.work)  # counts any call
    deliveries = with_redeliveries(unique := b.signed(events), STEADY_REDELIVERY_SHARE, seed=c)
    expected, tables = {json.loads(e.body)["data"]["object"]["id"] for e in events}, sorted(set(peer.TABLES.values()))
    with b.started("fake Stripe API (peer)", api):
        engine = peer.SyncEngine(b.peer_home(), b.work, database_url=database.url, secret=SECRET, spec=spec,
                                 path=payloads.SNAPSHOT_PATH, stripe_api_url=api.base_url, name=f"sync-engine-c{c}")
        with b.started("sync engine", engine):
            b.wrk.run(engine.port, b.signed(warm_events), 8, max_duration_s=60)  # warm-up: JIT, pool, plans
            time.sleep(0.5)  # the warm-up's last answers
            database.empty()
            api.control.clear_requests()
            errors0, deadlocks0, commits0 = len(engine.errors()), b.deadlocks(database.name), b.commits(database.name)
            b.db.reset_statements()
            wal0, pg0, node0, machine = b.db.one(SQL.bench_wal_lsn), b.pg.cpu_s(), engine.cpu_s(), MachineCpu().begin()
            r = b.wrk.run(engine.port, deliveries, c, max_duration_s=600)
            deadline = time.monotonic() + 10  # the requests in flight when wrk stopped timing: answered in moments
            while (missing := expected - database.object_ids(tables)) and time.monotonic() <= deadline:
                time.sleep(0.1)
            last_write, busy = database.last_write(tables), machine.end()
            node_s, pg_s = engine.cpu_s() - node0, b.pg.cpu_s() - pg0
            wal_bytes = b.db.one(SQL.bench_wal_bytes_since, {"lsn": wal0})
            statements = int(b.db.one(COUNTERS.bench_statement_calls_of, {"databases": [database.name]}))
            rows, requests, handler_errors = database.rows(tables), api.control.requests, len(engine.errors()) - errors0
    # Its backends exited with the engine: their counters are published.
    deadlocks, commits = b.deadlocks(database.name) - deadlocks0, b.commits(database.name) - commits0
    database.drop()
    n, e2e_s = len(unique), max(r.started_at + r.duration_s, last_write or 0.0) - r.started_at
    row = {"concurrency": c, "deliveries": len(deliveries), "events": n, "redeliveries": len(deliveries) - n,
           "ack_rps": r.rps, "ack_p50_ms": r.p50_ms, "ack_p99_ms": r.p99_ms, "ack_s": r.duration_s, "e2e_s": e2e_s,
           "e2e_eps": n / e2e_s if e2e_s > 0 else 0.0, "objects": len(expected), "objects_missing": len(missing),
           "rows": rows, "errors": r.errors + handler_errors + len(missing), "handler_errors": handler_errors,
           "stripe_api_requests": len(requests), "deadlocks": deadlocks, "busy": busy["busy"], "iowait": busy["iowait"],
           # Over its database alone (the checks above read it too: a few statements in all).
           "statements_per_event": statements / n, "commits_per_event": commits / n,
           "wal_kb_per_event": wal_bytes / 1024 / n, "redis_commands_per_event": 0.0,
           "cpu_ms": {"sync engine (node)": 1000 * node_s / n, "Postgres": 1000 * pg_s / n},
           "cpu_ms_total": 1000 * (node_s + pg_s) / n, "client_cpu_ms": {"wrk": 1000 * r.wrk_cpu_s / n}}
    log(f"  steady [sync engine {peer.VERSION}] c={c}: {row['e2e_eps']:.1f} events/s, errors {row['errors']}")
    return row


def run(b: Bench) -> dict[str, Any]:
    o = b.opts
    kinds, missing = STEADY_PAYLOADS[o.steady_payload], peer.available() if o.peer is None else None
    with_peer = o.peer if o.peer is not None else missing is None
    log(f"steady: {o.steady_events:,} events per level (+5% redeliveries) at c={o.steady_levels}; revisions "
        f"{[s.label for s in b.sides]}, brokers {o.brokers}, payloads {kinds}; sync engine: {missing or with_peer}")
    if with_peer:
        b.peer_home()  # installed (once) before anything is measured
    runs, peer_runs = {br: {s.label: {k: [] for k in kinds} for s in b.sides} for br in o.brokers}, []
    for c in o.steady_levels:
        events, warm_events = b.steady_source.backlog(o.steady_events), b.steady_source.backlog(200)
        for broker in o.brokers:
            with b.using_broker(broker):
                for side, kind in ((s, k) for s in b.sides for k in kinds):
                    with b.using(side):
                        runs[broker][side.label][kind].append(_steady_level(b, c, kind, events, warm_events))
        if with_peer:
            peer_runs.append(_peer_level(b, c, events, warm_events))
    sample = b.steady_source.backlog(500)
    revisions = lambda br: [{"label": s.label, "commit": s.revision.commit,  # noqa: E731
                             "runs": runs[br][s.label][kinds[0]], "payload_runs": runs[br][s.label]} for s in b.sides]
    node = peer.node_version() if with_peer else None
    return {"levels": list(o.steady_levels), "events_per_level": o.steady_events,
              "redelivery_share": STEADY_REDELIVERY_SHARE, "api_version": payloads.BASIL_API,
              "payload": payloads.size_stats(e.body for e in sample), "payloads": list(kinds),
              "thin_snapshot_twin": o.thin_snapshot_twin, "thin_payload": payloads.size_stats(
                  payloads.body(n) for n in payloads.thin_load(json.loads(e.body) for e in sample).notifications),
              "receiver_server": o.receiver_server, "receiver_workers": o.receiver_workers,
              "receiver_threads": o.receiver_threads, "workers": 2, "worker_concurrency": 2,
              "loadgen": "wrk 4 (1 thread, pre-signed requests replayed by a Lua script)",
              "broker": o.brokers[0], "revisions": revisions(o.brokers[0]),
              "brokers": {br: {"revisions": revisions(br)} for br in o.brokers},
              "peer": {"package": peer.PACKAGE_SPEC, "node": node, "pool_max": peer.POOL_MAX,
                       "settings": peer.SETTINGS.format(node=node), "runs": peer_runs} if with_peer else None}


def _role(result: dict[str, Any], role: str, broker: str | None = None) -> dict[str, Any] | None:  # on the first
    revs = result["brokers"][broker or result["broker"]]["revisions"]
    return next((r for r in revs if (r["commit"] is None) == (role == "current")), None)


def _by_c(rev: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    return {r["concurrency"]: r for r in rev["runs"]} if rev else {}


def _cpu(run: dict[str, Any], group: str) -> float:  # "broker": the Redis or RabbitMQ server the run used
    names = ("Redis", "RabbitMQ") if group == "broker" else (group,)
    return next((run["cpu_ms"][g] for g in names if g in run["cpu_ms"]), 0.0)


def _ratio(run: dict[str, Any], other: dict[str, Any] | None, key: str = "e2e_eps") -> float | None:
    return run[key] / other[key] if other and other[key] else None


def _counts(r: dict[str, Any]) -> str:  # RabbitMQ keeps no count of its commands; the sync engine has no broker
    broker = f"{r['redis_commands_per_event']:.1f}" if r.get("broker", "redis") == "redis" else "not counted"
    return f"{r['statements_per_event']:.1f} / {r['commits_per_event']:.2f} / {broker}"


# The tables' columns (key = header): ratios (×) of end-to-end events/s (CPU ×: of CPU), CPU in ms, all per event.
COLUMNS = [(k, k, "" if k in ("concurrency", "deadlocks", "errors") else ".2f") for k in (
    "system", "broker", "payload", "concurrency", "ack_rps", "ack_p99_ms", "e2e_eps", "× peer", "× compared",
    "cpu_ms_total", "CPU × compared", "statements/commits/broker commands", "API/event", "deadlocks", "errors")]


def report(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    first, peer_runs, rows, values = result["broker"], _by_c(result["peer"]), [], {}

    def put(prefix: str, c: int, **figures) -> None:
        values.update({f"{prefix}{k}_c{c}": v for k, v in figures.items() if v is not None})
    for broker in result["brokers"]:
        base, p = _by_c(_role(result, "compared", broker)), "" if broker == first else f"{broker}_"
        for rev, kind, r in ((rev, k, r) for rev in result["brokers"][broker]["revisions"]
                             for k, runs in rev["payload_runs"].items() for r in runs):
            old = base.get(r["concurrency"]) if rev["commit"] is None else None
            rows.append({**r, "system": rev["label"], "broker": LABELS[broker], "payload": kind,
                         "× peer": _ratio(r, peer_runs.get(r["concurrency"])), "× compared": _ratio(r, old),
                         "CPU × compared": _ratio(r, old, "cpu_ms_total"), "API/event": r.get("stripe_api", {}).get(
                             "per_event"), "statements/commits/broker commands": _counts(r)})
        for c, r in _by_c(_role(result, "current", broker)).items():
            put(p, c, **{k: r[k] for k in ("ack_rps", "ack_p50_ms", "ack_p99_ms", "e2e_eps")}, cpu_ms=r["cpu_ms_total"])
            if not p:
                put(p, c, **{f"cpu_ms_{g.replace(' ', '_')}": _cpu(r, g) for g in CPU_GROUPS},
                    wrk_cpu_ms=r["client_cpu_ms"]["wrk"])
            put(p, c, deadlocks=r["deadlocks"], e2e_vs_peer=_ratio(r, peer_runs.get(c)))
    for c, r in peer_runs.items():
        rows.append({**r, "system": "sync engine", "broker": "-", "payload": "snapshot",
                     "statements/commits/broker commands": _counts(r)})
        put("peer_", c, e2e_eps=r["e2e_eps"], ack_p99_ms=r["ack_p99_ms"], cpu_ms=r["cpu_ms_total"])
    text = ("every run (CPU: ms per processed event, all processes but the client; × peer, × compared: end-to-end "
            "events/s over theirs)\n" + table(sorted(rows, key=lambda row: row["concurrency"]), COLUMNS))
    runs, base = _by_c(_role(result, "current")), _by_c(compared := _role(result, "compared"))
    if compared is not None:
        values["compared"] = compared["label"]
        for c, r in runs.items():
            put("", c, e2e_ratio=_ratio(r, base.get(c)), cpu_ratio=_ratio(r, base.get(c), "cpu_ms_total"))
    if "thin" in (kinds := _role(result, "current")["payload_runs"]):
        values["payload"], snapshot = "+".join(kinds), {r["concurrency"]: r for r in kinds.get("snapshot", [])}
        for r in kinds["thin"]:
            old = snapshot.get(r["concurrency"])
            put("thin_", r["concurrency"], **{k: r[k] for k in ("e2e_eps", "ack_p50_ms", "ack_p99_ms")},
                cpu_ms=r["cpu_ms_total"], api_requests_per_event=r["stripe_api"]["per_event"],
                fake_api_cpu_ms=r["client_cpu_ms"]["fake Stripe API"], e2e_ratio=_ratio(r, old),
                cpu_ratio=_ratio(r, old, "cpu_ms_total"))
    values["errors"] = sum(row["errors"] for row in rows if row["system"] != "sync engine")
    if peer_runs:
        values["peer_errors"] = sum(r["errors"] for r in peer_runs.values())
    return text, values


def docs_table(result: dict[str, Any]) -> str:
    """The docs' opening table: per level, the sync engine and this project on each broker, and the ratio."""
    engine = _by_c(result["peer"])
    systems = [("sync engine", engine)] * bool(engine) + [
        (f"this project on {LABELS[br]}", _by_c(_role(result, "current", br))) for br in result["brokers"]]
    figures = [("events/s end to end", lambda r: f"{r['e2e_eps']:.0f}"),
               ("ratio to the sync engine", lambda r: r.get("broker") and _ratio(r, engine.get(r["concurrency"]))),
               ("ack p99 (ms)", lambda r: f"{r['ack_p99_ms']:.0f}"), ("deadlocks", lambda r: str(r["deadlocks"])),
               ("CPU ms per event (all processes)", lambda r: f"{r['cpu_ms_total']:.2f}"),
               ("statements / commits / broker commands per event", _counts)]
    rows = [{"": f"{name}, {figure}", **{c: cell(r) for c, r in runs.items()}}
            for name, runs in systems for figure, cell in figures]
    columns = [("", "", "")] + [(c, f"{c} connection{'s' * (c != 1)}", ".2f") for c in result["levels"]]
    return table([row for row in rows if any(v is not None for v in list(row.values())[1:])], columns, markdown=True)
