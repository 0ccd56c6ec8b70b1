"""A real product backend for the outbox's webhook sender, on 127.0.0.1, with faults on demand.

``EffectEndpoint`` is an ``http.server.ThreadingHTTPServer`` in a background
thread that behaves like a careful receiver of ``entitlements.changed`` /
``invoice.payment_failed`` webhooks:

* it verifies ``Ledger-Signature`` (``t=<unix>,v1=hex(hmac_sha256(secret, f"{t}." + body))``,
  the ``workers.effects.sign`` scheme) and answers 401 to anything else;
* it deduplicates by ``Idempotency-Key``: a key is *applied* the first time the
  endpoint answers 2xx for it and never again (later calls are answered 200 too);
* it keeps, per ordering key, the entitlements of the ``entitlements.changed``
  with the highest ``sequence`` it applied (what a receiver does with
  out-of-order deliveries).

Faults, drawn per call from a seeded RNG (``max_faults_per_key`` caps how many a
single key can get, so a run always converges within the retry budget):

* ``fail_fraction``: answer 503 (nothing applied);
* ``timeout_fraction``: apply, then sleep ``timeout_sleep_s`` (longer than the
  sender's ``OUTBOX_TIMEOUT_S``) before answering 200: the sender gives up and
  retries an effect that did land, which only the idempotency key makes safe;
* ``reject(status)``: answer that permanent 4xx to every call until ``heal()``;
  ``answer(status, retry_after=...)`` forces any status (a 2xx one applies; 429 with Retry-After);
* ``stall_s``: apply, then hold every answer that long (a slow backend; shorter than the
  sender's timeout, so a delivery stays in flight: the moment to kill a worker);
* ``down()`` / ``start()``: close / (re)bind the listening socket on the same port;
  an endpoint built with ``port=free_port()`` and not started is a closed port.

Every call is counted: ``calls_total[key]``, ``applied[key]`` (0 or 1),
``answers`` (status -> count), ``faults`` (kind -> count).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from devkit.procs import free_port

# OUTBOX_WEBHOOK_SECRET of the outbox tests (Settings wants 16+ characters).
SECRET = "outbox_test_secret_0123456789abcdef"


@dataclass(frozen=True)
class Call:
    """One request as the endpoint saw it (kept in arrival order)."""
    key: str | None
    status: int
    fault: str | None
    body: dict[str, Any] | None


def verify(header: str | None, body: bytes, secret: str, *, tolerance_s: int = 300) -> bool:
    """Check a Ledger-Signature header the way a product backend would (constant-time compare)."""
    if not header:
        return False
    parts: dict[str, list[str]] = {}
    for item in header.split(","):
        name, _, value = item.strip().partition("=")
        parts.setdefault(name, []).append(value)
    try:
        timestamp = int(parts["t"][0])
    except (KeyError, ValueError):
        return False
    if abs(time.time() - timestamp) > tolerance_s:
        return False
    expected = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return any(hmac.compare_digest(expected, candidate) for candidate in parts.get("v1", []))


class EffectEndpoint:
    def __init__(self, secret: str, *, port: int | None = None, fail_fraction: float = 0.0,
                 timeout_fraction: float = 0.0, timeout_sleep_s: float = 1.0, seed: int = 0,
                 max_faults_per_key: int | None = None):
        self.secret = secret
        self.port = port if port is not None else free_port()
        self.fail_fraction = fail_fraction
        self.timeout_fraction = timeout_fraction
        self.timeout_sleep_s = timeout_sleep_s
        self.max_faults_per_key = max_faults_per_key
        self.stall_s = 0.0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._forced: tuple[int, str | None, str | None] | None = None
        self.gets = 0  # GET requests (a landing page answers them 200: what a redirect would lead to)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.calls: list[Call] = []
        self.calls_total: Counter[str] = Counter()
        self.applied: Counter[str] = Counter()
        self.answers: Counter[int] = Counter()
        self.faults: Counter[str] = Counter()
        self.bad_signatures = 0
        self.key_mismatches = 0           # Idempotency-Key header differs from the body's id
        self.body_conflicts: list[str] = []  # one key seen with two different bodies
        self.first_body: dict[str, bytes] = {}
        self.effects: dict[str, dict[str, Any]] = {}   # key -> body applied
        self.apply_order: list[str] = []               # keys in the order they were applied
        # ordering key -> (sequence, entitlements) of the newest entitlements.changed applied
        self.entitlements: dict[str, tuple[int, list[str]]] = {}

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/effects"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> "EffectEndpoint":
        """Bind (or re-bind, after ``down()``) the same port and serve in a background thread."""
        if self._server is not None:
            return self
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                status, sleep_s, extra = endpoint._handle(self.headers, body)
                if sleep_s:
                    time.sleep(sleep_s)
                payload = b"" if status == 204 else json.dumps({"status": status}).encode()
                try:
                    self.send_response(status)
                    for name, value in extra.items():
                        self.send_header(name, value)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:
                    pass  # the sender gave up waiting (a timeout): the answer is lost, the effect is not

            def do_GET(self):  # noqa: N802
                with endpoint._lock:
                    endpoint.gets += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", "7")
                self.end_headers()
                self.wfile.write(b"welcome")

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"effect-endpoint-{self.port}", daemon=True)
        self._thread.start()
        return self

    def down(self) -> None:
        """Stop answering: the port is closed (connections are refused) until ``start()``."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    close = down

    # -- modes -----------------------------------------------------------------------------
    def answer(self, status: int, *, retry_after: str | None = None, location: str | None = None) -> None:
        """Answer every well-signed call with ``status`` until ``heal()`` (a 2xx status applies the key),
        with a Retry-After or a Location header if given."""
        with self._lock:
            self._forced = (status, retry_after, location)

    def reject(self, status: int = 422) -> None:
        """Answer ``status`` (a permanent 4xx) to every call until ``heal()``."""
        self.answer(status)

    def heal(self) -> None:
        """No more forced answers and no more random faults: every well-signed call succeeds."""
        with self._lock:
            self._forced = None
            self.fail_fraction = self.timeout_fraction = 0.0

    # -- the receiving side ------------------------------------------------------------------
    def _handle(self, headers, body: bytes) -> tuple[int, float, dict[str, str]]:
        """(status, seconds to sleep before answering, extra headers) for one call."""
        key = headers.get("Idempotency-Key")
        with self._lock:
            if not verify(headers.get("Ledger-Signature"), body, self.secret):
                self.bad_signatures += 1
                return self._answer(key, 401, None, None), 0.0, {}
            try:
                parsed = json.loads(body)
            except ValueError:
                return self._answer(key, 400, None, None), 0.0, {}
            if not key or parsed.get("id") != key:
                self.key_mismatches += 1
                return self._answer(key, 400, None, parsed), 0.0, {}
            self.calls_total[key] += 1
            first = self.first_body.setdefault(key, body)
            if first != body and key not in self.body_conflicts:
                self.body_conflicts.append(key)
            if self._forced is not None:
                status, retry_after, location = self._forced
                if 200 <= status < 300:
                    self._apply(key, parsed)
                    return self._answer(key, status, None, parsed), 0.0, {}
                extra = {name: value for name, value in (("Retry-After", retry_after), ("Location", location))
                         if value is not None}
                return self._answer(key, status, "forced", parsed), 0.0, extra
            fault = None
            if not self.applied[key] and (self.max_faults_per_key is None
                                          or self._faults_of(key) < self.max_faults_per_key):
                draw = self._rng.random()
                if draw < self.fail_fraction:
                    fault = "unavailable"
                elif draw < self.fail_fraction + self.timeout_fraction:
                    fault = "timeout"
            if fault == "unavailable":
                return self._answer(key, 503, fault, parsed), 0.0, {}
            self._apply(key, parsed)
            return (self._answer(key, 200, fault, parsed),
                    self.timeout_sleep_s if fault == "timeout" else self.stall_s, {})

    def _faults_of(self, key: str) -> int:
        return sum(1 for c in self.calls if c.key == key and c.fault in ("unavailable", "timeout"))

    def _answer(self, key, status, fault, parsed) -> int:
        self.calls.append(Call(key, status, fault, parsed))
        self.answers[status] += 1
        if fault:
            self.faults[fault] += 1
        return status

    def _apply(self, key: str, parsed: dict[str, Any]) -> None:
        """Apply a key once; a repeat is acknowledged and ignored (the receiver's dedup)."""
        if self.applied[key]:
            return
        self.applied[key] += 1
        self.effects[key] = parsed
        self.apply_order.append(key)
        if parsed.get("type") == "entitlements.changed" and parsed.get("ordering_key"):
            current = self.entitlements.get(parsed["ordering_key"])
            if current is None or parsed["sequence"] > current[0]:
                self.entitlements[parsed["ordering_key"]] = (parsed["sequence"],
                                                             list(parsed["data"]["entitlements"]))

    # -- inspection --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"calls_total": dict(self.calls_total), "applied": dict(self.applied),
                    "answers": dict(self.answers), "faults": dict(self.faults),
                    "bad_signatures": self.bad_signatures}

    def applied_keys(self) -> set[str]:
        with self._lock:
            return {k for k, n in self.applied.items() if n}

    def final_entitlements(self) -> dict[str, list[str]]:
        """Per ordering key (customer): the entitlements of the highest sequence applied."""
        with self._lock:
            return {k: sorted(v[1]) for k, v in self.entitlements.items()}

    def arrivals(self, effect: str | None = None) -> list[dict[str, Any]]:
        """Bodies of applied effects in the order they were applied."""
        with self._lock:
            return [self.effects[k] for k in self.apply_order
                    if effect is None or self.effects[k]["type"] == effect]
