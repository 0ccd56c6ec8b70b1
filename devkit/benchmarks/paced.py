"""The paced (open loop) ack client retention and reproject run beside their operations: stalls show as latency."""
from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable

from ..stack import http_request
from . import payloads
from .runner import SECRET, table
from .stack import MachineCpu

ACK_RATE = 100.0     # deliveries a second
ACK_WINDOW_S = 30.0  # each quiet window around the operation


class PacedClient:
    def __init__(self, port: int, templates: list[dict[str, Any]], seed: int):
        self._port, self._templates, self._rng = port, templates, random.Random(seed)
        self.phase, self.answers = "before", []  # (phase it was due in, ok, ms since it was due)
        self._next, self._lock, self.stop, self._started = 0, threading.Lock(), threading.Event(), time.monotonic()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(8)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            with self._lock:
                due, phase, evt = self._started + self._next / ACK_RATE, self.phase, self._rng.choice(self._templates)
                self._next += 1
            text = payloads.body({**evt, "id": payloads.event_id()})  # made before its time: the client's work untimed
            headers = {"Content-Type": "application/json", "Stripe-Signature": payloads.sign(text, SECRET)}
            if self.stop.wait(max(0.0, due - time.monotonic())):
                return
            try:
                status = http_request(self._port, "POST", payloads.SNAPSHOT_PATH, text.encode(), headers).status_code
            except OSError:
                status = 0
            self.answers.append((phase, 200 <= status < 300, (time.monotonic() - due) * 1000))


def around(b, steps: dict[str, Callable[[], Any] | None], *, seed: int, then: Callable[[], Any] = lambda: None):
    """Each of ``steps`` (None: ACK_WINDOW_S quiet) beside the paced client, then ``then`` with the workers still up."""
    port, phases = b.receiver().port, {}
    with b.readme_fleet():
        client = PacedClient(port, b.templates, seed)
        try:
            for phase, step in steps.items():
                client.phase, machine, started = phase, MachineCpu().begin(), time.monotonic()
                step() if step else time.sleep(ACK_WINDOW_S)
                phases[phase] = {"seconds": time.monotonic() - started, "busy": machine.end()["busy"]}
        finally:
            client.stop.set()
            for t in client.threads:
                t.join()
        settled = then()
    for phase, s in phases.items():
        oks = [ok for p, ok, _ in client.answers if p == phase]
        v = sorted(ms for p, ok, ms in client.answers if p == phase and ok) or [0.0]
        s.update(acks=sum(oks), p50_ms=v[int(0.5 * len(v))], p99_ms=v[int(0.99 * len(v))], max_ms=v[-1],
                 errors=len(oks) - sum(oks))
    return phases, settled


def ack_table(phases: dict[str, dict[str, Any]], note: str = "") -> str:
    rows = [{"window": name, **s} for name, s in phases.items()]
    return f"acknowledgements at {ACK_RATE:g}/s (paced, open loop), README workers running{note}\n" + table(rows, [
        ("window", "window", ""), ("acks", "acks", ""), ("p50_ms", "p50 ms", ".1f"), ("p99_ms", "p99 ms", ".1f"),
        ("max_ms", "max ms", ".1f"), ("errors", "errors", ""), ("busy", "machine busy", ".0%")])
