"""ops/bench retention (issues 30 and 41's targets): ingest and drain on two partitioned ledgers, empty and with
SCENARIO_EVENTS processed events over DAYS days, taking turns twice (the machine's drift falls on both); the console's
pages and the paced client around one ``ledgerctl retention run`` (processed kept 90 days, failed_permanent 120)."""
from __future__ import annotations

import json
import re
import subprocess
import time
from typing import Any

import psycopg
import requests

from devkit.stack import Console
from ledger.migrate import migrate

from .. import revisions
from ..paced import ACK_RATE, ack_table, around
from ..runner import history_label, log, prefill_history, scenario, table
from ..stack import partition, partition_months

DAYS = 180
SCENARIO_EVENTS = 3_000_000
TARGET_ARCHIVE_EPS = 10_000  # with the default budget, beside the stack
ACK_P99_RATIO = 1.5          # ack p99 during the run: at most this times its value before the run,
ACK_P99_MS = 20.0            # and at most this
CONSOLE_REQUESTS = 20
TARGETS = {"ack_drain_10pct": "ack rate and drain rate with the history within 10% of the empty ledger's",
           "swap_1s": "a month past the window leaves in a swap holding locks <= 1 s",
           "ack_p99_budget": f"ack p99 during the run <= {ACK_P99_RATIO:g} x before it, and <= {ACK_P99_MS:g} ms",
           "archive_10k": f"archive >= {TARGET_ARCHIVE_EPS:,} events/s with the default budget",
           "console_100ms": "every console page <= 100 ms p95 with the history"}
PASSWORD = "bench-password"
# The console's list, filters and overview: each a page of the table, one request at a time (latency, not load).
PAGES = {"overview": "/", "events, no filter (last 7 days)": "/events",
         "status=failed_permanent": "/events?status=failed_permanent", "status=processed": "/events?status=processed",
         "type=invoice.*": "/events?type=invoice.*",
         "reason=unmappable_payload": "/events?status=failed_permanent&reason=unmappable_payload",
         "source=thin": "/events?source=thin", "source=catchup": "/events?source=catchup",
         "source=webhook": "/events?source=webhook", "account=platform": "/events?account=platform",
         "account=acct_bench7": "/events?account=acct_bench7",
         "livemode=live, type=customer.*": "/events?livemode=live&type=customer.*", "failures grouped": "/failures"}


def _percentile(values: list[float], q: float) -> float:
    return sorted(values)[round(q * (len(values) - 1))]


def _console_pages(b) -> dict[str, Any]:
    """Each of PAGES CONSOLE_REQUESTS times after 3 warm-ups, on ``ledgerctl console`` (gunicorn, as docs/console.md
    runs it) by a real HTTP client logged in through the form with its CSRF token."""
    from ops.console.auth import hash_password

    env = {**b.env, "LEDGER_CONSOLE_USERS": f"bench:{hash_password(PASSWORD)}", "LEDGER_CONSOLE_SECRET_KEY": "b" * 48,
           "LOG_LEVEL": "WARNING"}
    with b.started("console", Console(env, b.work)) as console:
        client = requests.Session()
        page = client.get(f"{console.url}/login", timeout=10)
        token = re.search(r'name="csrf_token" type="hidden" value="([^"]+)"', page.text).group(1)
        answer = client.post(f"{console.url}/login", data={"name": "bench", "password": PASSWORD, "csrf_token": token},
                             allow_redirects=False, timeout=10)
        assert answer.status_code == 302, answer.text[:300]
        rows = {}
        for name, path in PAGES.items():
            for _ in range(3):
                client.get(console.url + path, timeout=60).raise_for_status()
            times = []
            for _ in range(CONSOLE_REQUESTS):
                started = time.perf_counter()
                answer = client.get(console.url + path, timeout=60)
                times.append((time.perf_counter() - started) * 1000)
                answer.raise_for_status()
            rows[name] = {"p50_ms": _percentile(times, 0.5), "p95_ms": _percentile(times, 0.95), "max_ms": max(times)}
    worst = max(rows, key=lambda k: rows[k]["p95_ms"])
    log(f"  console: worst page {worst} p95 {rows[worst]['p95_ms']:.1f} ms")
    return {"pages": rows, "worst": worst, "worst_p95_ms": rows[worst]["p95_ms"]}


def _acks_around_a_run(b) -> dict[str, Any]:
    """The paced client through a retention-free window, ``ledgerctl retention run``, another such window."""
    archive = b.work / "retention-archive"
    env = {**b.env, "LEDGER_ARCHIVE_URL": str(archive), "LEDGER_RETAIN_PROCESSED_DAYS": "90",
           "LEDGER_RETAIN_FAILED_DAYS": "120"}
    runs = []

    def retention_run() -> None:
        log(f"retention: ledgerctl retention run, {ACK_RATE:g} deliveries/s meanwhile")
        done = subprocess.run([b.checkout.tool("ledgerctl"), "retention", "run", "--json"], env=env,
                              capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"ledgerctl retention run exited {done.returncode}: {done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout))

    phases, _ = around(b, {"before": None, "during": retention_run, "after": None}, seed=311)
    run = runs[0]
    archive_s = run["read_s"] + run["store_s"]
    run["archive_eps"] = run["archived"] / archive_s if archive_s else 0.0
    run["archive_bytes"] = sum(f.stat().st_size for f in archive.rglob("*") if f.is_file())
    return {"rate": ACK_RATE, "phases": phases, "run": run}


def run(b) -> dict[str, Any]:
    total = 100_000 if b.opts.quick else SCENARIO_EVENTS
    label = history_label(total)
    sides = {"empty": b.side, label: b.side_for(revisions.current(), "ledger_bench_history", migrate)}
    for side in sides.values():
        with b.using(side):
            if not b.db.one("SELECT ledger.is_partitioned()"):
                partition(b.db.url)
            b.label = "empty"
            b.clear()
    with b.using(sides[label]):
        with psycopg.connect(b.db.url, autocommit=True) as conn:
            partition_months(conn, DAYS)
        history = prefill_history(b, total, days=DAYS, step_s=DAYS * 86400 / total)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    try:
        for round_, name in [(round_, name) for round_ in (1, 2) for name in sides]:
            with b.using(sides[name]):
                b.label = name
                log(f"retention: ingest and drain [{name}], round {round_}")
                rounds[name].append({"ingest": scenario("ingest").run(b), "drain": scenario("drain").run(b)})
        with b.using(sides[label]):
            b.label = label
            console, acks = _console_pages(b), _acks_around_a_run(b)
            b.clear()
    finally:
        b.label = "empty"
    # Each figure: its value on each ledger in each round, and the ratio of the rounds' means.
    empty, full = rounds["empty"], rounds[label]

    def figure(value) -> dict[str, Any]:
        f = {"empty": [value(r) for r in empty], "history": [value(r) for r in full]}
        return {**f, "ratio": (sum(f["history"]) / len(f["history"])) / (sum(f["empty"]) / len(f["empty"]) or 1)}

    figures = {f"ingest req/s c={level['concurrency']}": figure(lambda r, i=i: r["ingest"]["levels"][i]["rps"])
               for i, level in enumerate(empty[0]["ingest"]["levels"])}
    figures.update({f"drain events/s workers={d['workers']}": figure(
        lambda r, i=i: r["drain"]["runs"][i]["events_per_s"]) for i, d in enumerate(empty[0]["drain"]["runs"])})
    ratios = {name: f["ratio"] for name, f in figures.items()}
    ph, run_ = acks["phases"], acks["run"]
    targets = {"ack_drain_10pct": min(ratios.values()) >= 0.9,
               "swap_1s": run_["partitions_dropped"] > 0 and run_["longest_drop_s"] <= 1.0,
               "ack_p99_budget": ph["during"]["p99_ms"] <= min(ACK_P99_RATIO * ph["before"]["p99_ms"], ACK_P99_MS),
               "archive_10k": run_["archive_eps"] >= TARGET_ARCHIVE_EPS,
               "console_100ms": console["worst_p95_ms"] <= 100.0}
    return {"events": total, "days": DAYS, "history": history, "empty": empty, "full": full, "ratios": ratios,
            "figures": figures, "console": console, "acks": acks, "quiet_p99_ms": ph["before"]["p99_ms"],
            "targets": targets}


def report(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    ph, run, console = result["acks"]["phases"], result["acks"]["run"], result["console"]
    text = "\n".join([
        f"partitioned ledger; history {result['events']:,} processed events over {result['days']} days "
        f"(database {result['history']['database_mb']:.0f} MB)",
        table([{"figure": name, "empty": ", ".join(f"{v:,.0f}" for v in f["empty"]), "ratio": f["ratio"],
                "history": ", ".join(f"{v:,.0f}" for v in f["history"])} for name, f in result["figures"].items()],
              [("figure", "figure", ""), ("empty", "empty, rounds 1 and 2", ""),
               ("history", "with the history, rounds 1 and 2", ""), ("ratio", "history / empty (means)", ".3f")]),
        ack_table(ph),
        f"retention run {run['status']}: archived {run['archived']:,} events at {run['archive_eps']:,.0f}/s (reading "
        f"and compressing {run['read_s']:.1f} s, writing and reading back {run['store_s']:.1f} s), "
        f"{run['archive_bytes'] / 1e6:.0f} MB; removed {run['removed']:,}; months replaced {run['partitions_dropped']} "
        f"(kept {run['kept_in_month']:,}), longest swap {1000 * run['longest_drop_s']:.0f} ms, months deferred "
        f"{run['months_deferred']}; whole run {run['seconds']:.0f} s",
        f"console, worst page: {console['worst']} p95 {console['worst_p95_ms']:.1f} ms"]
        + [f"- {TARGETS[k]}: {'met' if ok else 'NOT MET'}" for k, ok in result["targets"].items()])
    values = {"min_ratio": min(result["ratios"].values()), "archive_eps": run["archive_eps"],
              "build_cpu_us": 1e6 * run["build_cpu_s"] / max(run["archived"], 1),
              "longest_swap_ms": 1000 * run["longest_drop_s"], "ack_p99_before_ms": ph["before"]["p99_ms"],
              "ack_p99_during_ms": ph["during"]["p99_ms"], "ack_p99_after_ms": ph["after"]["p99_ms"],
              "ack_errors": sum(s["errors"] for s in ph.values()), "console_worst_p95_ms": console["worst_p95_ms"],
              "months_replaced": run["partitions_dropped"], "months_deferred": run["months_deferred"]}
    values.update({f"target_{k}": "met" if ok else "not_met" for k, ok in result["targets"].items()})
    return text, values
