"""One object's page on a ledger of 1,000,000 events (issue 40; docs/benchmarks.md, "One object's page"):
the console's object page (no Stripe fetch) and ``ledgerctl objects show`` ≤ 100 ms p95, for a subscription
with 50 events and for a customer with 20 subscriptions.

A private PostgreSQL (the bench's settings, the ledger's schema) gets ``--events`` background rows by SQL:
console_list's fill, each event also naming its object ('obj_<n>') and that object's customer (one of 50,000
'cus_bench<k>') in its payload and in object_id / customer_id, as the receiver records them. Then the two
objects as Stripe-shaped events (devkit.factories' subscriptions, dressed as devkit.benchmarks.payloads
dresses them), parsed by the receiver's parser, recorded by its EventStore and processed by the workers'
EventProcessor with the built-in handlers, so their billing.* rows are the workers' own: a subscription
with 50 events (created, 48 updates of status, quantity, items and period, deleted; its customer, an invoice
every fourth update) and a customer with 20 subscriptions (each created, invoice.created, invoice.paid, updated).

Timed one at a time, ``--requests`` times after 3 warm-ups: ``GET /objects/<id>`` on ``ledgerctl console``
(logged in as console_list does) and ``ObjectView(pool, registry).show(id)`` in-process, as ``ledgerctl
objects show`` makes it; then whole ``ledgerctl objects show ID --json`` processes (interpreter start
included: reported, not judged). ``EXPLAIN (ANALYZE, BUFFERS)`` of the view's ``object_events`` query is
printed once per id. ``--docs`` writes the section of docs/benchmarks.md between its markers.

    ops/devkit-run devkit.benchmarks.object_page [--events 1000000] [--requests 60] [--partitioned] [--docs]
"""
from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from devkit.benchmarks.console_list import (FILL, arguments, busy_share, console_variables, cpu_times, fill,
                                            measure, p, session, write_docs)
from devkit.benchmarks.payloads import _Dresser, body
from devkit.benchmarks.stack import migrated_database
from devkit.factories import SubscriptionHistory, customer, event, new_id
from devkit.procs import REPO, Cleanup, venv_tool
from devkit.stack import Console, stack_env
from ledger.attempts import WorkerLedger
from ledger.config import Settings
from ledger.db import ProcessPool
from ledger.deliveries import EventStore
from ledger.queries import SQL
from ledger.stripe_events import parse_event
from workers.object_view import ObjectView
from workers.processor import EventProcessor
from workers.registry import load_handlers

TARGET_P95_MS = 100.0
BEGIN, END = "<!-- object-bench:begin -->", "<!-- object-bench:end -->"
HEADING = "## One object's page: 1,000,000 events (issue 40)"
BROKER = "redis://127.0.0.1:6379/15"
PROCESS_RUNS = 5
DAY = 86400


def _swap(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"console_list.FILL changed: {old!r}"
    return text.replace(old, new)


# console_list's fill, each event also naming its object and that object's customer (payload and columns).
OBJECT_FILL = _swap(_swap(_swap(
    FILL, "updated_at)\nSELECT", "updated_at, object_id, customer_id)\nSELECT"),
    """'","object":"customer"}}}'""", """'","object":"customer","customer":"cus_bench' || (n %% 50000) || '"}}}'"""),
    ", at\n  FROM generate_series", ", at, 'obj_' || n, 'cus_bench' || (n %% 50000)\n  FROM generate_series")


def subscription_story(start: int) -> SubscriptionHistory:
    """A subscription's 50 events, its customer's creation, and an invoice paid every fourth update."""
    h = SubscriptionHistory(start=start)
    h.add("customer.created", customer(created=start, customer_id=h.customer_id))
    h.add("customer.subscription.created", h._subscription("trialing", start, trial_end=start + 14 * DAY))
    period = start
    for i in range(48):
        period = start + 14 * DAY + (i // 4) * 30 * DAY
        sub = h._subscription(("active", "active", "past_due", "active")[i % 4], period,
                              cancel_at_period_end=i == 47)
        sub["quantity"] = sub["items"]["data"][0]["quantity"] = 1 + i % 5
        h.add("customer.subscription.updated", sub)
        if i % 4 == 0:
            h.add("invoice.paid", h._paid(h._invoice("open", 0, period, "subscription_cycle")))
    end = period + 30 * DAY
    h.add("customer.subscription.deleted", h._subscription("canceled", period, canceled_at=end, ended_at=end))
    return h


def customer_story(start: int, subscriptions: int = 20) -> tuple[str, list[dict]]:
    """A customer with ``subscriptions`` subscriptions: each created, invoiced, paid, then active."""
    customer_id = new_id("cus")
    events = [event("customer.created", customer(created=start, customer_id=customer_id), created=start)]
    for k in range(subscriptions):
        h = SubscriptionHistory(start=start + 60 + k * 600, customer_id=customer_id)
        h.add("customer.subscription.created", h._subscription("incomplete", start))
        invoice = {**h._invoice("open", 0, start, "subscription_create"), "status": "draft"}
        h.add("invoice.created", invoice)
        h.add("invoice.paid", h._paid(invoice))
        h.add("customer.subscription.updated", h._subscription("active", start))
        events += h.events
    return customer_id, events


def record_and_process(url: str, events: list[dict]) -> None:
    """Each event as the receiver records it (its parser, its EventStore), then a worker's attempt at it."""
    settings = Settings(database_url=url)
    pool = ProcessPool(settings, name="bench-objects")
    try:
        store = EventStore(pool)
        processor = EventProcessor.from_settings(settings, WorkerLedger(pool), load_handlers(settings), None)
        for evt in events:
            store.record_delivery(parse_event(body(evt).encode()))
            outcome = processor.process(evt["id"]).value
            assert outcome == "processed", f"{evt['type']} {evt['id']}: {outcome}"
    finally:
        pool.close()


def explain(url: str, object_id: str) -> list[str]:
    """The plan of the view's events query for ``object_id``, printed; its node types."""
    with psycopg.connect(url, autocommit=True) as conn:
        plan = [r[0] for r in conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + SQL.object_events, {"id": object_id})]
    print(f"\nEXPLAIN (ANALYZE, BUFFERS) object_events, id={object_id}\n" + "\n".join(plan), flush=True)
    nodes = [m.group(1) for m in (re.match(r"\s*(?:->\s*)?(.+?)\s+\(cost=", line) for line in plan) if m]
    return list(dict.fromkeys(nodes))


def in_process(url: str, object_id: str, n: int) -> list[float]:
    """``ObjectView(pool, registry).show(id)`` as ``ledgerctl objects show`` builds it, timed after 3 warm-ups."""
    settings = Settings(database_url=url)
    pool = ProcessPool(settings, name="ledgerctl", max_size=2)
    try:
        view = ObjectView(pool, load_handlers(settings))
        for _ in range(3):
            assert view.show(object_id) is not None
        times = []
        for _ in range(n):
            started = time.perf_counter()
            view.show(object_id)
            times.append((time.perf_counter() - started) * 1000)
        return times
    finally:
        pool.close()


def process_runs(env: dict[str, str], object_id: str) -> tuple[list[float], dict]:
    """The wall time of whole ``ledgerctl objects show ID --json`` processes; the last one's story."""
    times, out = [], ""
    for _ in range(PROCESS_RUNS):
        started = time.perf_counter()
        out = subprocess.run([venv_tool("ledgerctl"), "objects", "show", object_id, "--json"], cwd=REPO, env=env,
                             check=True, capture_output=True, text=True, timeout=120).stdout
        times.append((time.perf_counter() - started) * 1000)
    return times, json.loads(out)


def report(args, judged: list[tuple[str, list[float]]], processes: list[tuple[str, list[float]]],
           plans: dict[str, list[str]], busy: float) -> str:
    worst = max(p(t, 0.95) for _, t in judged)
    verdict = "PASS" if worst <= TARGET_P95_MS else "FAIL"
    lines = [f"`ops/devkit-run devkit.benchmarks.object_page --events {args.events}"
             f"{' --partitioned' if args.partitioned else ''}` — {args.events:,} background events (each naming "
             f"its object and one of 50,000 customers), plus a subscription with 50 events and a customer with 20 "
             f"subscriptions recorded by the receiver's code and processed by the workers'. Console (gunicorn) "
             f"pages and the in-process `ObjectView.show` {len(judged[0][1])} times each after 3 warm-ups, one at "
             f"a time, no Stripe fetch; the machine was {busy:.0%} busy meanwhile.", "",
             "| page | p50 ms | p95 ms | max ms |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {p(t, 0.5):.1f} | {p(t, 0.95):.1f} | {max(t):.1f} |" for name, t in judged]
    lines += [f"| {name} (process, {len(t)} runs, not judged) | {p(t, 0.5):.1f} | — | {max(t):.1f} |"
              for name, t in processes]
    lines += ["", "`object_events` plan nodes: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in plans.items()) + ".",
              "", f"Target: every page and the in-process show ≤ {TARGET_P95_MS:.0f} ms p95 with {args.events:,} events: "
              f"**{verdict}** (worst p95 {worst:.1f} ms)."]
    return "\n".join(lines)


def main() -> int:
    args = arguments(__doc__)
    work = Path(tempfile.mkdtemp(prefix="ledger-object-bench-"))
    cleanup = Cleanup("object-bench")
    try:
        url = migrated_database(cleanup, "object_bench", partitioned=args.partitioned)
        print(f"filling {args.events:,} events", flush=True)
        fill(url, args.events, statement=OBJECT_FILL)
        now = int(time.time())
        history = subscription_story(now - 40 * DAY)
        customer_id, customer_events = customer_story(now - 20 * DAY)
        dress = _Dresser().dress
        real = sorted(map(dress, history.events + customer_events), key=lambda e: (e["created"], e["id"]))
        print(f"recording and processing {len(real)} events of the two objects", flush=True)
        record_and_process(url, real)
        with psycopg.connect(url, autocommit=True) as conn:
            for table in ("ledger.events", "ledger.deliveries", "ledger.attempts"):
                conn.execute(f"VACUUM (ANALYZE) {table}")
            conn.execute("ANALYZE")
        ids = {"subscription, 50 events": history.subscription_id, "customer, 20 subscriptions": customer_id}
        plans = {name: explain(url, object_id) for name, object_id in ids.items()}
        env = stack_env(url, BROKER, console_variables())
        console = Console(env, work).start()
        cleanup.add("console", console.kill)
        client = session(console.url)
        judged, processes = [], []
        cpu_before = cpu_times()
        for name, object_id in ids.items():
            for label, times in ((f"console /objects/<{name}>", measure(client, f"{console.url}/objects/{object_id}",
                                                                          args.requests)),
                                 (f"ObjectView.show(<{name}>)", in_process(url, object_id, args.requests))):
                judged.append((label, times))
                print(f"  {label:<50} p50 {p(times, 0.5):7.1f} ms  p95 {p(times, 0.95):7.1f} ms", flush=True)
        busy = busy_share(cpu_before, cpu_times())
        for name, object_id in ids.items():
            times, story = process_runs(env, object_id)
            processes.append((f"ledgerctl objects show <{name}> --json", times))
            print(f"  ledgerctl objects show <{name}>: {len(story['events'])} own events, rebuilt from "
                  f"{story['rebuilt_from']}, links {({k: len(v) for k, v in story['links'].items()})}; "
                  f"p50 {p(times, 0.5):.0f} ms", flush=True)
        text = report(args, judged, processes, plans, busy)
        print("\n" + text)
        if args.docs:
            write_docs(text, markers=(BEGIN, END), heading=HEADING)
        return 0 if "**PASS**" in text else 1
    finally:
        cleanup.run()


if __name__ == "__main__":
    raise SystemExit(main())
