"""The operator console's list, filters and overview on a ledger of 1,000,000 events (docs/benchmarks.md,
"Operator console").

A private PostgreSQL (the bench's settings) gets the ledger's schema (``ledgerctl migrate``'s code) and
``--events`` rows written straight by SQL: the list's speed depends on the rows there are, not on how
they came (the receiver's path is the steady scenario's). The mix: 96.5% processed, 1% failed_permanent
over four reasons, 0.5% failed_recoverable, 1.5% received, 0.5% processing; 12 snapshot types and 5%
thin notifications (v1.*); 20% of events of 50 connected accounts; half in live mode; received over the
last 60 days; a delivery row each, 2% of them from catch-up.

Then ``ledgerctl console`` (gunicorn, as docs/console.md runs it) answers a real HTTP client (requests,
logged in through the login form with its CSRF token) one request at a time: each page of the table
``--requests`` times after a warm-up, newest data first. Printed: p50/p95/max per page and the machine's
busy share. ``--docs`` writes the section of docs/benchmarks.md between its markers.

    ops/devkit-run devkit.benchmarks.console_list [--events 1000000] [--requests 60] [--docs]
"""
from __future__ import annotations

import argparse
import hashlib
import re
import tempfile
import time
from pathlib import Path

import psycopg
import requests

from devkit.benchmarks.stack import migrated_database, partition_months
from devkit.procs import REPO, Cleanup
from devkit.stack import Console, stack_env

TARGET_P95_MS = 100.0
DOCS = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- console-bench:begin -->", "<!-- console-bench:end -->"
PASSWORD = "bench-password"

FILL = """
INSERT INTO ledger.events (id, type, status, attempts, failure_reason, last_error, stripe_created, livemode,
                           api_version, account, payload, received_at, wakeup_at, next_attempt_at, lease_owner,
                           lease_expires_at, processed_at, updated_at)
SELECT 'evt_' || left(md5(n::text), 24),
       CASE WHEN n %% 20 = 0 THEN 'v1.' ELSE '' END || (ARRAY['customer.created', 'customer.updated',
            'customer.subscription.created', 'customer.subscription.updated', 'customer.subscription.deleted',
            'invoice.created', 'invoice.finalized', 'invoice.paid', 'invoice.payment_failed',
            'checkout.session.completed', 'charge.succeeded', 'payment_intent.succeeded'])[1 + n %% 12],
       s.status, CASE WHEN s.status = 'received' THEN 0 ELSE 1 + n %% 3 END,
       CASE WHEN s.status LIKE 'failed%%' THEN (ARRAY['unmappable_payload', 'rejected_by_handler',
            'object_without_id', 'retries_exhausted'])[1 + n %% 4] END,
       CASE WHEN s.status LIKE 'failed%%' THEN 'a failure, as a handler words it' END,
       at - interval '2 seconds', n %% 2 = 0, '2024-06-20',
       CASE WHEN n %% 5 = 0 THEN 'acct_bench' || (n %% 50) END,
       ('{"id":"evt_' || left(md5(n::text), 24) || '","object":"event","data":{"object":{"id":"obj_' || n
        || '","object":"customer"}}}')::json,
       at, at, CASE WHEN s.status = 'failed_recoverable' THEN now() + interval '1 hour' END,
       CASE WHEN s.status = 'processing' THEN 'bench:0' END,
       CASE WHEN s.status = 'processing' THEN now() + interval '1 hour' END,
       CASE WHEN s.status = 'processed' THEN at + interval '1 second' END, at
  FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS n,
       LATERAL (SELECT now() - make_interval(secs => ((%(total)s::bigint - n) * 5184000.0 / %(total)s::bigint)) AS at) t,
       LATERAL (SELECT CASE WHEN n %% 200 < 2 THEN 'failed_permanent' WHEN n %% 200 = 2 THEN 'failed_recoverable'
                            WHEN n %% 200 IN (3, 4, 5) THEN 'received' WHEN n %% 200 = 6 THEN 'processing'
                            ELSE 'processed' END AS status) s
"""
DELIVERIES = """
INSERT INTO ledger.deliveries (event_id, event_created, delivered_at, source)
SELECT id, stripe_created, received_at, CASE WHEN hashtext(id) %% 50 = 0 THEN 'catchup' ELSE 'webhook' END FROM ledger.events
"""
ATTEMPTS = """
INSERT INTO ledger.attempts (event_id, event_created, attempt, worker, lease_owner, started_at, finished_at, outcome, error_class)
SELECT id, stripe_created, 1, 'bench:0', 'bench:0', updated_at, updated_at, status, 'BenchError'
  FROM ledger.events WHERE status IN ('failed_permanent', 'failed_recoverable')
"""

PAGES = {
    "overview": "/",
    "events, no filter (last 7 days)": "/events",
    "status=failed_permanent": "/events?status=failed_permanent",
    "status=processed": "/events?status=processed",
    "type=invoice.*": "/events?type=invoice.*",
    "reason=unmappable_payload": "/events?status=failed_permanent&reason=unmappable_payload",
    "source=thin": "/events?source=thin",
    "source=catchup": "/events?source=catchup",
    "source=webhook": "/events?source=webhook",
    "account=platform": "/events?account=platform",
    "account=acct_bench7": "/events?account=acct_bench7",
    "livemode=live, type=customer.*": "/events?livemode=live&type=customer.*",
    "31-day range": None,             # filled in: the widest range allowed
    "id=<one event>": f"/events?id=evt_{hashlib.md5(b'457').hexdigest()[:24]}",
    "page 20 of the list": None,      # filled in: the 20th page by the keyset
    "one event": f"/events/evt_{hashlib.md5(b'457').hexdigest()[:24]}",
    "failures grouped": "/failures",
}


def busy_share(before: list[int], after: list[int]) -> float:
    idle = after[3] - before[3]
    total = sum(after) - sum(before)
    return 1 - idle / total if total else 0.0


def cpu_times() -> list[int]:
    with open("/proc/stat") as fh:
        return [int(x) for x in fh.readline().split()[1:8]]


def fill(url: str, total: int, *, statement: str = FILL) -> None:
    """``total`` events by ``statement`` (FILL, or a variant of it), with their deliveries and attempts."""
    with psycopg.connect(url, autocommit=True) as conn:
        partition_months(conn, 60)
        step = 200_000
        for first in range(1, total + 1, step):
            last = min(total, first + step - 1)
            started = time.monotonic()
            conn.execute(statement, {"first": first, "last": last, "total": total})
            print(f"  events {last:,} ({time.monotonic() - started:.1f} s)", flush=True)
        conn.execute(DELIVERIES, {})
        conn.execute(ATTEMPTS)
        conn.execute("VACUUM (ANALYZE) ledger.events")
        conn.execute("VACUUM (ANALYZE) ledger.deliveries")
        conn.execute("VACUUM (ANALYZE) ledger.attempts")


def console_variables() -> dict[str, str]:
    """The console's settings for the bench: one user ("bench", PASSWORD), a secret key, quiet logs."""
    from ops.console.auth import hash_password

    return {"LEDGER_CONSOLE_USERS": f"bench:{hash_password(PASSWORD)}", "LEDGER_CONSOLE_SECRET_KEY": "b" * 48,
            "LOG_LEVEL": "WARNING"}


def session(base: str) -> requests.Session:
    client = requests.Session()
    page = client.get(f"{base}/login", timeout=10)
    token = re.search(r'name="csrf_token" type="hidden" value="([^"]+)"', page.text).group(1)
    answer = client.post(f"{base}/login", data={"name": "bench", "password": PASSWORD, "csrf_token": token},
                         allow_redirects=False, timeout=10)
    assert answer.status_code == 302, answer.text[:300]
    return client


def deep_page(client: requests.Session, base: str, pages: int) -> str:
    path = "/events"
    for _ in range(pages - 1):
        text = client.get(base + path, timeout=30).text
        path = re.search(r'href="([^"]+)" id="next"', text).group(1).replace("&amp;", "&")
    return path


def measure(client: requests.Session, url: str, n: int) -> list[float]:
    for _ in range(3):
        client.get(url, timeout=60).raise_for_status()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        answer = client.get(url, timeout=60)
        times.append((time.perf_counter() - started) * 1000)
        answer.raise_for_status()
    return times


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def report(total: int, rows: list[tuple[str, list[float]]], busy: float) -> str:
    worst = max(p(t, 0.95) for _, t in rows)
    verdict = "PASS" if worst <= TARGET_P95_MS else "FAIL"
    lines = [f"`ops/devkit-run devkit.benchmarks.console_list --events {total}` — {total:,} events in the ledger, "
             f"`ledgerctl console` (gunicorn, 1 process × 8 threads), one client (requests) logged in, each page "
             f"{len(rows[0][1])} times after 3 warm-up requests; event ids are random, as Stripe's. The machine (2 cores, shared) was {busy:.0%} busy "
             f"while they were timed: one request at a time, this is latency, not load.", "",
             "| page | p50 ms | p95 ms | max ms |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {p(t, 0.5):.1f} | {p(t, 0.95):.1f} | {max(t):.1f} |" for name, t in rows]
    lines += ["", f"Target: every page ≤ {TARGET_P95_MS:.0f} ms p95 with 1,000,000 events: **{verdict}** "
              f"(worst p95 {worst:.1f} ms)."]
    return "\n".join(lines)


def write_docs(text: str, *, markers: tuple[str, str] = (BEGIN, END),
               heading: str = "## Operator console: 1,000,000 events") -> None:
    """``text`` into docs/benchmarks.md between ``markers``, or at its end under ``heading`` the first time."""
    begin, end = markers
    doc = DOCS.read_text()
    section = f"{begin}\n{text}\n{end}"
    if begin in doc:
        doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: section, doc, flags=re.S)
    else:
        doc = doc.rstrip() + f"\n\n{heading}\n\n" + section + "\n"
    DOCS.write_text(doc)


def arguments(doc: str) -> argparse.Namespace:
    """The options of a bench of console pages (this one's, object_page's): --events, --requests, --docs,
    --partitioned."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=60, help="timed requests per page")
    parser.add_argument("--docs", action="store_true", help="write the result into docs/benchmarks.md")
    parser.add_argument("--partitioned", action="store_true", help="partition the ledger first (by month)")
    return parser.parse_args()


def main() -> int:
    args = arguments(__doc__)
    work = Path(tempfile.mkdtemp(prefix="ledger-console-bench-"))
    cleanup = Cleanup("console-bench")
    try:
        url = migrated_database(cleanup, "console_bench", partitioned=args.partitioned)
        print(f"filling {args.events:,} events", flush=True)
        fill(url, args.events)
        env = stack_env(url, "redis://127.0.0.1:6379/15", console_variables())
        console = Console(env, work).start()
        cleanup.add("console", console.kill)
        base = console.url
        client = session(base)
        since = time.strftime("%Y-%m-%dT%H:%M", time.gmtime(time.time() - 31 * 86400 + 120))
        pages = dict(PAGES)
        pages["31-day range"] = f"/events?since={since}"
        pages["page 20 of the list"] = deep_page(client, base, 20)
        rows = []
        cpu_before = cpu_times()
        for name, path in pages.items():
            times = measure(client, base + path, args.requests)
            rows.append((name, times))
            print(f"  {name:<34} p50 {p(times, 0.5):7.1f} ms  p95 {p(times, 0.95):7.1f} ms", flush=True)
        text = report(args.events, rows, busy_share(cpu_before, cpu_times()))
        print("\n" + text)
        if args.docs:
            write_docs(text)
        return 0 if "PASS" in text else 1
    finally:
        cleanup.run()


if __name__ == "__main__":
    raise SystemExit(main())
