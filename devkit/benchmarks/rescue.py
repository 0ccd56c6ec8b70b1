"""ops/bench rescue: how soon a dead worker's events are processed again, as users run the stack.

The README stack (the receiver, two ``celery -A workers worker --concurrency 2``, ``ledgerctl sweep
--loop``), every setting at its default: the lease 120 s, the rescuer every second, keepalives ending a
silent host's sessions after 10 s. Events are the chaos run's mix (subscription lifecycles and
``chaos.effect`` events, whose rows count exactly-once: devkit.chaos), fed over HTTP so that about
IN_FLIGHT of them are unfinished at any moment. Meanwhile, every few seconds, the chaos run's kills
by their weights: a pool process SIGKILLed (4), or a whole worker, parent and children, SIGKILLed and
another started (2). Each victim is a process holding leases at that moment, never the one running the
slow event, whose handler runs three times the rescue target inside its transaction.

Per kill: the events the dead processes held leases on at the kill, and the time from the kill to the
last of them processed (and to the last taken over: its attempt closed as worker_lost). An event taken
over by a process that a later kill hits is that kill's too: its time to processed counts both. Then the run
checks what the chaos run checks (nothing lost, no effect twice, billing equal to the events applied
in order) and that no slow event was taken over. Each broker runs twice, taking turns (Redis, RabbitMQ,
Redis, RabbitMQ with ``--broker both``); a target counts as met only if the worse run meets it.
"""
from __future__ import annotations

import http.client
import os
import random
import signal
import threading
import time
import uuid
from typing import Any

import psycopg

from devkit import chaos
from devkit.factories import body_of, event, sign
from devkit.procs import pid_alive, wait_until
from devkit.stack import ReadmeWorker

from .stack import Stack

IN_FLIGHT = 500
RESCUE_TARGET_S = 15.0
SLOW_S = 3 * RESCUE_TARGET_S
KINDS = (("kill_worker_child", 4), ("kill_worker", 2))  # the chaos run's kills, by its weights


def rescue(b) -> dict[str, Any]:
    from .scenarios import QUEUE, SECRET, SIGNATURE_TOLERANCE_S, log

    quick = b.opts.quick
    kills = 4 if quick else 10
    b.stop_receiver()
    runs = []
    for round_ in (1, 2):
        for broker in b.opts.brokers:
            with b.using_broker(broker):
                log(f"rescue, round {round_} on {b.broker_label}: {kills} kills at ~{IN_FLIGHT} events in flight")
                runs.append(_run(b, broker, round_, kills=kills, log=log, queue=QUEUE, secret=SECRET,
                                 tolerance_s=SIGNATURE_TOLERANCE_S))
                b.drop_queue()
    return {"runs": runs, "in_flight_target": IN_FLIGHT, "target_s": RESCUE_TARGET_S, "slow_s": SLOW_S,
            "brokers": list(b.opts.brokers)}


class _Feeder:
    """Delivers events over HTTP from a few threads (persistent connections, signed as Stripe signs), keeping
    about IN_FLIGHT unfinished; every non-2xx answer is retried, as Stripe does."""

    def __init__(self, port: int, secret: str, bodies: list[str], unfinished):
        self.port, self.secret, self.bodies = port, secret, bodies
        self.unfinished = unfinished
        self.next = 0
        self.sent = 0
        self.non_2xx = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(6)]

    def start(self) -> "_Feeder":
        for thread in self.threads:
            thread.start()
        return self

    def _take(self) -> str | None:
        with self.lock:
            if self.next >= len(self.bodies):
                return None
            body, self.next = self.bodies[self.next], self.next + 1
            return body

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self.stop.is_set():
            if self.unfinished() >= IN_FLIGHT:
                time.sleep(0.02)
                continue
            body = self._take()
            if body is None:
                return
            while not self.stop.is_set():
                try:
                    conn.request("POST", "/webhooks/stripe", body=body.encode(), headers={
                        "Content-Type": "application/json", "Stripe-Signature": sign(body, self.secret)})
                    response = conn.getresponse()
                    response.read()
                    if 200 <= response.status < 300:
                        with self.lock:
                            self.sent += 1
                        break
                except OSError:
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                with self.lock:
                    self.non_2xx += 1
                time.sleep(0.1)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


def _run(b, broker: str, round_: int, *, kills: int, log, queue: str, secret: str, tolerance_s: int) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    admin = b.pg.url_for("postgres")
    name, ref_name = f"rescue_{tag}", f"rescue_{tag}_ref"
    url = chaos.create_database(admin, name)
    ref_url = chaos.create_database(admin, ref_name)
    rng = random.Random(round_ * 1000 + len(broker))
    # More than a run delivers (it stops feeding once the kills are over): only what was delivered is checked.
    count = 16_000 if b.opts.quick else 60_000
    events = chaos.build_events(count, rng)
    now = int(time.time())
    slow = [event("chaos.effect", {"id": f"chaos_slow_{k}", "object": "chaos", "sleep_s": SLOW_S}, created=now)
            for k in range(1)]
    bodies = [body_of(e) for e in [*slow, *events]]
    env = b.checkout.env(url, b.broker_url, {
        "STRIPE_WEBHOOK_SECRET": secret, "LEDGER_QUEUE": queue, "STRIPE_SIGNATURE_TOLERANCE_S": str(tolerance_s),
        "LEDGER_HANDLER_MODULES": chaos.HANDLERS, "CHAOS_FAULT_RATE": "0", "LOG_LEVEL": "WARNING"})
    label = f"rescue{round_}{broker}"
    stack = Stack(env, b.work, queue=queue, label=label, checkout=b.checkout, receiver_server=b.opts.receiver_server,
                  receiver_workers=b.opts.receiver_workers, receiver_threads=b.opts.receiver_threads)
    b.cleanup.add(f"{label} stack", stack.stop)
    monitor = psycopg.connect(url, autocommit=True, application_name="bench-monitor")
    lock = threading.Lock()

    def q(sql: str, *params):
        with lock:
            return monitor.execute(sql, params).fetchall()

    state = {"unfinished": 0, "samples": []}
    stop_sampling = threading.Event()

    def sample() -> None:
        with psycopg.connect(url, autocommit=True, application_name="bench-sampler") as conn:
            while not stop_sampling.wait(0.2):
                state["unfinished"] = conn.execute(
                    "SELECT count(*) FROM ledger.events WHERE status IN ('received', 'processing', "
                    "'failed_recoverable')").fetchone()[0]
                state["samples"].append(state["unfinished"])

    workers: list[ReadmeWorker] = list(stack.fleet.workers)
    replacements = 0
    record: list[dict[str, Any]] = []
    feeder = None
    sampler = threading.Thread(target=sample, daemon=True)
    try:
        stack.start()
        sampler.start()
        feeder = _Feeder(stack.receiver.port, secret, bodies, lambda: state["unfinished"]).start()
        wait_until(lambda: state["unfinished"] >= IN_FLIGHT * 0.8, timeout_s=120, interval_s=0.2,
                   what=f"{IN_FLIGHT} events in flight")
        slow_ids = {e["id"] for e in slow}
        for n in range(kills):
            time.sleep(rng.uniform(4.0, 7.0))
            kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
            held = _leases(q)
            busy_slow = {pid for pid, attempts in held.items() if {e for e, _ in attempts} & slow_ids}
            live = [w for w in workers if w.alive]
            candidates = {pid: ids for pid, ids in held.items() if pid not in busy_slow}
            if kind == "kill_worker_child":
                pids = [rng.choice(sorted(candidates))] if candidates else []
            else:
                pools = [w for w in live if set(w.children()) & set(candidates)
                         and not set(w.children()) & busy_slow]
                victim = rng.choice(pools) if pools else None
                pids = [victim.pid, *victim.children()] if victim is not None else []
            if not pids:
                continue
            if kind == "kill_worker_child":
                try:
                    os.kill(pids[0], signal.SIGKILL)
                except ProcessLookupError:  # it ended between the choice and the kill: choose again
                    continue
            else:
                victim.kill()
            killed_at = q("SELECT clock_timestamp()")[0][0]
            # The attempts it was running; those that did not commit (_measure) are its events.
            theirs = sorted(set().union(*(held.get(pid, set()) for pid in pids)))
            record.append({"kind": kind, "pids": pids, "killed_at": killed_at, "attempts": theirs})
            if kind == "kill_worker":
                wait_until(lambda: not any(pid_alive(p) for p in pids), timeout_s=10, what="the pool to be gone")
                replacements += 1
                successor = b.checkout.adopt(ReadmeWorker(env, b.work, concurrency=2,
                                                          node=f"{label}-r{replacements}-{tag}"))
                successor.start()
                workers.append(successor)
                b.cleanup.add(f"{label} successor", successor.kill)
            log(f"  kill {n + 1}/{kills}: {kind} of {len(pids)} process(es) running {len(theirs)} attempt(s); "
                f"{state['unfinished']} in flight")
        # Until every killed process's events are processed (the measure), then the rest drains.
        held_ids = sorted({e for k in record for e, _ in k["attempts"]} | slow_ids)
        wait_until(lambda: not q("SELECT 1 FROM ledger.events WHERE id = ANY(%s) AND status <> 'processed' LIMIT 1",
                                 held_ids), timeout_s=300, interval_s=0.5, what="the killed workers' events")
        feeder.stop.set()
        feeder.close()
        sent = feeder.sent
        wait_until(lambda: not q("SELECT 1 FROM ledger.events WHERE status IN ('received', 'processing', "
                                 "'failed_recoverable') LIMIT 1"), timeout_s=600, interval_s=0.5,
                   what="the ledger to be quiescent")
        stop_sampling.set()
        kills_out = [_measure(q, kill) for kill in record]
        slow_attempts = {r[0]: r[1] for r in q("SELECT event_id, count(*) FROM ledger.attempts WHERE event_id = ANY(%s) "
                                                "GROUP BY event_id", sorted(slow_ids))}
        delivered_ids = {r[0] for r in q("SELECT id FROM ledger.events")}
        delivered = [e for e in [*slow, *events] if e["id"] in delivered_ids]
        log(f"  quiescent; checking {len(delivered)} events against the same events applied in order")
        result = chaos.Result(events=len(delivered), broker=broker)
        reference = chaos.reference_snapshot(delivered, ref_url)
        problems = chaos.check(delivered, url, reference, result, 0.0)
        lease_expired = q("SELECT count(*) FROM ledger.attempts WHERE outcome = 'lease_expired'")[0][0]
    finally:
        stop_sampling.set()
        if feeder is not None:
            feeder.close()
        stack.stop()
        for worker in workers:
            worker.kill()
        b.cleanup.remove(stack.stop)
        monitor.close()
        for db in (name, ref_name):
            try:
                chaos.drop_database(admin, db)
            except Exception as exc:  # reported, the run's figures stand
                log(f"could not drop {db}: {exc}")
    samples = state["samples"] or [0]
    processed_s = sorted(k["processed_s"] for k in kills_out if k["events"])
    return {"broker": broker, "round": round_, "events_sent": sent, "kills": kills_out,
            "in_flight_mean": sum(samples) / len(samples), "in_flight_max": max(samples),
            "p50_s": _rank(processed_s, 0.50), "p99_s": _rank(processed_s, 0.99), "max_s": max(processed_s or [0.0]),
            "takeover_p99_s": _rank(sorted(k["taken_over_s"] for k in kills_out if k["events"]), 0.99),
            "held_events": sum(k["events"] for k in kills_out), "lease_expired_attempts": lease_expired,
            "slow_events": len(slow), "slow_taken_over": sum(1 for n in slow_attempts.values() if n != 1),
            "lost": result.lost, "duplicated_effects": result.duplicated_effects,
            "missing_effects": result.missing_effects, "billing_mismatches": result.billing_mismatches,
            "stuck": result.stuck, "failed": result.failed, "problems": problems, "ok": result.ok and not problems}


def _leases(q) -> dict[int, set[tuple[str, int]]]:
    """pid -> the attempts it runs now under a lease: (event id, attempt)."""
    out: dict[int, set[tuple[str, int]]] = {}
    for worker, event_id, attempt in q(
            "SELECT a.worker, a.event_id, a.attempt FROM ledger.attempts a JOIN ledger.events e ON e.id = a.event_id "
            "AND e.lease_owner = a.lease_owner WHERE a.outcome = 'running'"):
        out.setdefault(int(worker.rsplit(":", 1)[1]), set()).add((event_id, attempt))
    return out


def _measure(q, kill: dict[str, Any]) -> dict[str, Any]:
    # Its events: those whose attempt it was running did not commit (one that committed as it died is not).
    ids = [event_id for event_id, attempt in kill["attempts"]
           if q("SELECT outcome FROM ledger.attempts WHERE event_id = %s AND attempt = %s", event_id, attempt)[0][0]
           != "processed"]
    if not ids:
        return {"kind": kill["kind"], "events": 0, "processed_s": 0.0, "taken_over_s": 0.0, "outcomes": {},
                "timeline": []}
    processed_s = q("SELECT extract(epoch FROM max(processed_at) - %s) FROM ledger.events WHERE id = ANY(%s)",
                    kill["killed_at"], ids)[0][0]
    # Each event's first takeover after the kill (a later one is a later kill's), the last of them.
    taken = q("SELECT extract(epoch FROM max(first) - %s) FROM (SELECT min(finished_at) AS first FROM ledger.attempts "
              "WHERE event_id = ANY(%s) AND finished_at >= %s AND outcome IN ('worker_lost', 'lease_expired') "
              "GROUP BY event_id) AS t", kill["killed_at"], ids, kill["killed_at"])[0][0]
    outcomes = dict(q("SELECT outcome, count(*) FROM ledger.attempts WHERE event_id = ANY(%s) AND started_at <= %s "
                      "AND (finished_at IS NULL OR finished_at >= %s) GROUP BY outcome", ids, kill["killed_at"],
                      kill["killed_at"]))
    # What became of them after the kill, for a run whose figures need explaining.
    timeline = [{"event": e[-8:], "attempt": a, "worker": w, "outcome": o, "error_class": c,
                 "started_s": float(s), "finished_s": None if f is None else float(f)}
                for e, a, w, o, c, s, f in q(
                    "SELECT event_id, attempt, worker, outcome, error_class, extract(epoch FROM started_at - %s), "
                    "extract(epoch FROM finished_at - %s) FROM ledger.attempts WHERE event_id = ANY(%s) "
                    "AND (finished_at IS NULL OR finished_at >= %s) ORDER BY event_id, attempt",
                    kill["killed_at"], kill["killed_at"], ids, kill["killed_at"])]
    return {"kind": kill["kind"], "events": len(ids), "processed_s": float(processed_s),
            "taken_over_s": float(taken or 0.0), "outcomes": outcomes, "timeline": timeline}


def _rank(values: list[float], p: float) -> float:
    """The nearest-rank percentile (of few values: p99 of 10 is the largest)."""
    if not values:
        return 0.0
    return values[min(len(values) - 1, max(0, int(-(-p * len(values) // 1)) - 1))]


def worse(runs: list[dict[str, Any]], broker: str) -> dict[str, Any] | None:
    """The broker's worse run: the larger p99 (the one a target must hold for)."""
    mine = [r for r in runs if r["broker"] == broker]
    return max(mine, key=lambda r: r["p99_s"]) if mine else None


def summary(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A table of every run, and the summary figures (the worse run per broker)."""
    from .report import table

    rows = [{"run": f"{r['broker']} #{r['round']}", "kills": len(r["kills"]), "held": r["held_events"],
             "in_flight": r["in_flight_mean"], "p50": r["p50_s"], "p99": r["p99_s"], "max": r["max_s"],
             "takeover": r["takeover_p99_s"], "expired": r["lease_expired_attempts"],
             "lost": r["lost"], "dup": r["duplicated_effects"], "billing": r["billing_mismatches"],
             "slow": f"{r['slow_taken_over']}/{r['slow_events']}", "ok": "yes" if r["ok"] else "NO"}
            for r in result["runs"]]
    text = table(rows, [("run", "run", ""), ("kills", "kills", "d"), ("held", "events held", "d"),
                        ("in_flight", "in flight", ".0f"), ("p50", "p50 s", ".1f"), ("p99", "p99 s", ".1f"),
                        ("max", "max s", ".1f"), ("takeover", "taken over p99 s", ".1f"),
                        ("expired", "lease_expired", "d"), ("lost", "lost", "d"), ("dup", "dup", "d"),
                        ("billing", "billing diff", "d"), ("slow", "slow taken over", ""), ("ok", "checks", "")])
    values: dict[str, Any] = {}
    for broker in result["brokers"]:
        r = worse(result["runs"], broker)
        values.update({f"{broker}_p99_s": r["p99_s"], f"{broker}_max_s": r["max_s"],
                       f"{broker}_lost": r["lost"], f"{broker}_dup": r["duplicated_effects"],
                       f"{broker}_slow_taken_over": r["slow_taken_over"],
                       f"{broker}_target": "met" if (r["p99_s"] <= result["target_s"] and r["ok"]
                                                      and not r["slow_taken_over"]) else "not_met"})
    return text, values
