"""rescue: how soon a dead worker's events run again on the README stack at its defaults: the chaos run's events (6
threads keep about IN_FLIGHT unfinished) and kills (never of the slow event's process), then the chaos run's checks."""
from __future__ import annotations

import http.client
import os
import random
import signal
import threading
import time
from collections import Counter
from typing import Any

import psycopg

from devkit import chaos
from devkit.benchmarks.runner import QUEUE, SECRET, Bench, log, table
from devkit.benchmarks.stack import ReadmeWorker, Stack
from devkit.factories import body_of, event, sign
from devkit.procs import Cleanup, pid_alive, wait_until

IN_FLIGHT, RESCUE_TARGET_S = 500, 15.0
SLOW_S = 3 * RESCUE_TARGET_S
LEASES = ("SELECT regexp_replace(a.worker, '^.*:', '')::int, array_agg(a.event_id), array_agg(a.attempt) FROM ledger."
          "attempts a JOIN ledger.events e ON (e.id, e.lease_owner) = (a.event_id, a.lease_owner) WHERE a.outcome = "
          "'running' GROUP BY 1")
COLUMNS = [(k, k.replace("_", " "), ".1f" if k.endswith("_s") else ".0f" if k == "in_flight_mean" else "") for k in (
    "run", "kills", "held_events", "in_flight_mean", "p50_s", "p99_s", "max_s", "takeover_p99_s",
    "lease_expired_attempts", "lost", "duplicated_effects", "billing_mismatches", "slow_taken_over", "checks")]
UNFINISHED = "SELECT count(*) FROM ledger.events WHERE status IN ('received', 'processing', 'failed_recoverable')"


def run(b: Bench) -> dict[str, Any]:
    kills, runs = 4 if b.opts.quick else 10, []
    b.stop_receiver()
    for round_, broker in [(round_, broker) for round_ in (1, 2) for broker in b.opts.brokers]:
        with b.using_broker(broker):
            log(f"rescue, round {round_} on {b.broker_label}: {kills} kills at ~{IN_FLIGHT} events in flight")
            runs.append(_run(b, broker, round_, kills))
            b.drop_queue()
    return {"runs": runs, "in_flight_target": IN_FLIGHT, "target_s": RESCUE_TARGET_S, "slow_s": SLOW_S,
            "brokers": list(b.opts.brokers)}


class _Load:
    def __init__(self, url: str, port: int, bodies: list[str]):
        self.url, self.port, self.bodies, self.sent, self.unfinished, self.samples = url, port, iter(bodies), [], 0, []
        self.feeding, self.sampling = threading.Event(), threading.Event()
        self.feeders = [threading.Thread(target=self._feed, daemon=True) for _ in range(6)]
        for thread in [threading.Thread(target=self._sample, daemon=True), *self.feeders]:
            thread.start()

    def _sample(self) -> None:
        with psycopg.connect(self.url, autocommit=True, application_name="bench-sampler") as conn:
            while not self.sampling.wait(0.2):
                self.unfinished = conn.execute(UNFINISHED).fetchone()[0]
                self.samples.append(self.unfinished)

    def _feed(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self.feeding.is_set() and (body := next(self.bodies, None)) is not None:  # next() is atomic
            while self.unfinished >= IN_FLIGHT and not self.feeding.is_set():
                time.sleep(0.02)
            while not self.feeding.is_set():
                try:
                    conn.request("POST", "/webhooks/stripe", body=body.encode(), headers={
                        "Content-Type": "application/json", "Stripe-Signature": sign(body, SECRET)})
                    (response := conn.getresponse()).read()  # all of it, before the next request
                    if 200 <= response.status < 300:
                        self.sent.append(body)
                        break
                except OSError:
                    conn.close()  # the next request connects again
                time.sleep(0.1)

    def stop_feeding(self) -> None:
        self.feeding.set()
        for thread in self.feeders:
            thread.join(30)


def _run(b: Bench, broker: str, round_: int, kills: int) -> dict[str, Any]:
    tag, admin, label = f"{random.getrandbits(32):08x}", b.pg.url_for("postgres"), f"rescue{round_}{broker}"
    events = chaos.build_events(16_000 if b.opts.quick else 60_000, rng := random.Random(round_ * 1000 + len(broker)))
    slow = event("chaos.effect", {"id": "chaos_slow_0", "object": "chaos", "sleep_s": SLOW_S}, created=int(time.time()))
    done = Cleanup("bench")  # this round's, newest first
    try:
        for name in (databases := [f"rescue_{tag}", f"rescue_{tag}_ref"]):
            done.add(f"database {name}", lambda name=name: chaos.drop_database(admin, name))
        url, ref_url = (chaos.create_database(admin, name) for name in databases)
        env = {**b.env, "DATABASE_URL": url, "LEDGER_HANDLER_MODULES": chaos.HANDLERS, "LOG_LEVEL": "WARNING"}
        stack = Stack(env, b.work, queue=QUEUE, label=label, checkout=b.checkout,
                      **{f"receiver_{k}": getattr(b.opts, f"receiver_{k}") for k in ("server", "workers", "threads")})
        done.add(f"{label} stack", stack.stop)  # its fleet's list holds the successors too
        monitor = psycopg.connect(url, autocommit=True, application_name="bench-monitor")
        done.add("monitor connection", monitor.close)
        q = lambda sql, *params: monitor.execute(sql, params).fetchall()  # noqa: E731
        workers, record = stack.fleet.workers, []
        stack.start()
        load = _Load(url, stack.receiver.port, [body_of(e) for e in [slow, *events]])
        done.add("the load", lambda: (load.sampling.set(), load.stop_feeding()))
        wait_until(lambda: load.unfinished >= IN_FLIGHT * 0.8, timeout_s=120, interval_s=0.2, what="events in flight")
        for n in range(kills):
            time.sleep(rng.uniform(4.0, 7.0))
            kind = rng.choices(("kill_worker_child", "kill_worker"), (4, 2))[0]  # the chaos run's kills, by its weights
            held = {pid: set(zip(ids, attempts)) for pid, ids, attempts in q(LEASES)}
            candidates = {pid for pid, attempts in held.items() if slow["id"] not in {e for e, _ in attempts}}
            if kind == "kill_worker_child" and candidates:
                pids = [rng.choice(sorted(candidates))]
                try:
                    os.kill(pids[0], signal.SIGKILL)
                except ProcessLookupError:  # it ended between the choice and the kill: choose again
                    continue
            elif kind == "kill_worker" and (pools := [w for w in workers if w.alive and set(w.children()) & candidates
                                                      and set(w.children()) & held.keys() <= candidates]):
                victim = rng.choice(pools)
                pids = [victim.pid, *victim.children()]
                victim.kill()
            else:
                continue
            record.append({"kind": kind, "at": q("SELECT clock_timestamp()")[0][0],
                           "attempts": sorted(set().union(*(held.get(pid, set()) for pid in pids)))})  # see _measure
            if kind == "kill_worker":
                wait_until(lambda: not any(pid_alive(p) for p in pids), timeout_s=10, what="the pool to be gone")
                workers.append(b.checkout.adopt(ReadmeWorker(env, b.work, concurrency=2,
                                                             node=f"{label}-r{len(workers)}-{tag}")).start())
            log(f"  kill {n + 1}: {kind} {pids}, {len(record[-1]['attempts'])} attempts, {load.unfinished} in flight")
        held_ids = sorted({e for k in record for e, _ in k["attempts"]} | {slow["id"]})
        wait_until(lambda: not q("SELECT 1 FROM ledger.events WHERE id = ANY(%s) AND status <> 'processed' LIMIT 1",
                                 held_ids), timeout_s=300, interval_s=0.5, what="the killed workers' events")
        load.stop_feeding()
        wait_until(lambda: not q(UNFINISHED)[0][0], timeout_s=600, interval_s=0.5, what="the ledger to be quiescent")
        load.sampling.set()
        kills_out = [_measure(q, **kill) for kill in record]
        delivered_ids = {r[0] for r in q("SELECT id FROM ledger.events")}
        delivered = [e for e in [slow, *events] if e["id"] in delivered_ids]  # a run sends fewer than built
        log(f"  quiescent; checking {len(delivered)} events against the same events applied in order")
        res = chaos.Result(events=len(delivered), broker=broker)
        issues = chaos.check(delivered, url, chaos.reference_snapshot(delivered, ref_url), res, 0.0)
        [(lease_expired, slow_attempts)] = q("SELECT count(*) FILTER (WHERE outcome = 'lease_expired'), count(*) "
                                             "FILTER (WHERE event_id = %s) FROM ledger.attempts", slow["id"])
    finally:
        done.run()
    samples, processed_s = load.samples, sorted(k["processed_s"] for k in kills_out if k["events"])
    return {"broker": broker, "round": round_, "events_sent": len(load.sent), "kills": kills_out,
            "in_flight_mean": sum(samples) / len(samples), "in_flight_max": max(samples),
            "p50_s": _rank(processed_s, 0.50), "p99_s": _rank(processed_s, 0.99), "max_s": max(processed_s or [0.0]),
            "takeover_p99_s": _rank(sorted(k["taken_over_s"] for k in kills_out if k["events"]), 0.99),
            "held_events": sum(k["events"] for k in kills_out), "lease_expired_attempts": lease_expired,
            "slow_events": 1, "slow_taken_over": int(slow_attempts > 1), **{k: getattr(res, k) for k in (
                "lost", "duplicated_effects", "missing_effects", "billing_mismatches", "stuck", "failed")},
            "problems": issues, "ok": res.ok and not issues}


def _measure(q, kind: str, at, attempts: list[tuple[str, int]]) -> dict[str, Any]:
    """Its events (attempts that did not commit): time to the last processed and last first takeover; their fates."""
    ids = [e for e, attempt in attempts if q("SELECT outcome FROM ledger.attempts WHERE event_id = %s AND attempt = %s",
                                             e, attempt)[0][0] != "processed"]
    [(last,)] = q("SELECT extract(epoch FROM max(processed_at) - %s) FROM ledger.events WHERE id = ANY(%s)", at, ids)
    [(taken,)] = q("SELECT extract(epoch FROM max(first) - %s) FROM (SELECT min(finished_at) AS first FROM ledger."
                   "attempts WHERE event_id = ANY(%s) AND finished_at >= %s AND outcome IN ('worker_lost', "
                   "'lease_expired') GROUP BY event_id) AS t", at, ids, at)
    timeline = [{"event": e[-8:], "attempt": a, "worker": w, "outcome": o, "error_class": c, "started_s": float(s),
                 "finished_s": None if f is None else float(f)} for e, a, w, o, c, s, f in q(
        "SELECT event_id, attempt, worker, outcome, error_class, extract(epoch FROM started_at - %s), extract(epoch "
        "FROM finished_at - %s) FROM ledger.attempts WHERE event_id = ANY(%s) AND (finished_at IS NULL OR "
        "finished_at >= %s) ORDER BY event_id, attempt", at, at, ids, at)]
    return {"kind": kind, "events": len(ids), "processed_s": float(last or 0.0), "taken_over_s": float(taken or 0.0),
            "timeline": timeline, "outcomes": dict(Counter(t["outcome"] for t in timeline if t["started_s"] <= 0))}


def _rank(values: list[float], p: float) -> float:
    return values[int(-(-p * len(values) // 1)) - 1] if values else 0.0  # nearest rank: p99 of 10 is the max


def report(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Every run; the figures are each broker's worse run (the larger p99: the one a target must hold for)."""
    runs = result["runs"]
    rows = [{**r, "run": f"{r['broker']} #{r['round']}", "kills": len(r["kills"]), "checks": "yes" if r["ok"] else "NO",
             "slow_taken_over": f"{r['slow_taken_over']}/{r['slow_events']}"} for r in runs]
    worse = {b: max((r for r in runs if r["broker"] == b), key=lambda r: r["p99_s"]) for b in result["brokers"]}
    return table(rows, COLUMNS), {f"{b}_{k}": v for b, r in worse.items() for k, v in (
        ("p99_s", r["p99_s"]), ("max_s", r["max_s"]), ("lost", r["lost"]), ("dup", r["duplicated_effects"]),
        ("slow_taken_over", r["slow_taken_over"]),
        ("target", "met" if r["p99_s"] <= result["target_s"] and r["ok"] and not r["slow_taken_over"] else "not_met"))}
