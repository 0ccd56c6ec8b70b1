"""A Stripe webhook delivery simulator, for tests, benchmarks and local runs.

It behaves the way Stripe's webhook delivery does, with time compressed:

* every attempt is signed the way Stripe signs it (``Stripe-Signature: t=<now>,v1=<hmac>``
  over the exact body text, see ``devkit.factories.sign``) and POSTed over HTTP;
* an attempt answered with anything but 2xx, or not answered within the timeout,
  is redelivered with exponential backoff (``base_s * 2**(n-1)``, capped at ``cap_s``)
  until it is acknowledged or ``max_attempts`` attempts were made (then Stripe gives up);
* it may send spontaneous duplicates of an event (a ``duplicates`` fraction of the
  events gets a second delivery later in the run), concurrent duplicates (copies
  released together from threads), and out-of-order histories (reversed, or shuffled
  within a window: no event moves ``window`` or more places from where it belongs);
* every answer is recorded per event id: HTTP status (``None`` for a timeout or a
  refused connection), the JSON outcome, and why the attempt was made.

Events come from real payloads (the JSON files of a fixture directory, kept byte for
byte; by default ``../shared/stripe-fixtures`` next to the repository, skipped when
absent) and from generated histories (``devkit.factories.SubscriptionHistory().lifecycle()``).

    python -m devkit.stripe_sim --url http://127.0.0.1:8000/webhooks/stripe --secret whsec_... \\
        --lifecycles 10 --duplicates 0.2 --shuffle

prints one line: ``events=... deliveries=... non_2xx=... redeliveries=... ...``.
"""
from __future__ import annotations

import argparse
import heapq
import http.client
import itertools
import json
import os
import random
import re
import secrets
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Protocol, Sequence
from urllib.parse import urlsplit

from devkit.factories import BASIL_API, OLD_API, SubscriptionHistory, body_of, sign
from devkit.procs import run_together

DEFAULT_FIXTURES_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "stripe-fixtures"
USER_AGENT = "Stripe/1.0 (+https://stripe.com/docs/webhooks)"

# Why an attempt was made.
FIRST = "first"            # the event's first delivery
RETRY = "retry"            # Stripe's redelivery after a non-2xx answer or a timeout
DUPLICATE = "duplicate"    # a spontaneous second delivery of an event (Stripe does send those)
CONCURRENT = "concurrent"  # one of several copies released at the same moment
MANUAL = "manual"          # sent again on request (a test's "Stripe retries the event")


# -- events -------------------------------------------------------------------------------

@dataclass(frozen=True)
class SimEvent:
    """One Stripe event as it goes over the wire: its id, type and the exact body text."""
    id: str
    type: str
    body: str
    created: int | None = None
    source: str = "generated"

    @classmethod
    def from_dict(cls, evt: dict, *, source: str = "generated") -> "SimEvent":
        return cls(id=evt["id"], type=evt["type"], body=body_of(evt), created=evt.get("created"), source=source)

    @classmethod
    def from_text(cls, text: str, *, source: str = "text") -> "SimEvent":
        evt = json.loads(text)
        return cls(id=str(evt.get("id")), type=str(evt.get("type")), body=text, created=evt.get("created"),
                   source=source)

    @property
    def data(self) -> dict:
        return json.loads(self.body)

    def with_id(self, new_id: str) -> "SimEvent":
        """The same event under another id, changing only the id's characters in the body text."""
        pattern = re.compile(r'("id"\s*:\s*)"' + re.escape(self.id) + '"')
        text, n = pattern.subn(lambda m: m.group(1) + json.dumps(new_id), self.body, count=1)
        if n != 1 or json.loads(text).get("id") != new_id:
            evt = json.loads(self.body)
            evt["id"] = new_id
            text = json.dumps(evt, indent=2)
        return SimEvent(id=new_id, type=self.type, body=text, created=self.created, source=self.source)


def lifecycle_events(lifecycles: int = 1, *, api_version: str = OLD_API, start: int = 1_700_000_000,
                     **history_kwargs) -> list[SimEvent]:
    """``lifecycles`` subscription lifecycles, each in the order Stripe would emit it, one after another."""
    out: list[SimEvent] = []
    for _ in range(lifecycles):
        history = SubscriptionHistory(api_version=api_version, start=start, **history_kwargs).lifecycle()
        out.extend(SimEvent.from_dict(evt) for evt in history.events)
    return out


def fixture_events(directory: str | os.PathLike | None = None, *, unique_ids: bool = True,
                   types: Iterable[str] | None = None) -> list[SimEvent]:
    """Every ``*.json`` event file of ``directory`` (default: the shared fixtures), bodies kept as they are.

    An absent directory gives no events. Community fixtures reuse placeholder ids
    (``evt_000...``) across files; with ``unique_ids`` each file gets an id of its
    own (its original id plus a random suffix, only those characters changed), so
    each file is delivered as the independent event it stands for.
    """
    root = Path(directory) if directory is not None else DEFAULT_FIXTURES_DIR
    if not root.is_dir():
        return []
    wanted = set(types) if types is not None else None
    out = []
    for path in sorted(root.glob("*.json")):
        text = path.read_text(encoding="utf-8")
        try:
            evt = SimEvent.from_text(text, source=path.name)
        except ValueError:
            continue
        if wanted is not None and evt.type not in wanted:
            continue
        if unique_ids:
            evt = evt.with_id(f"{evt.id}_{secrets.token_hex(6)}")
        out.append(evt)
    return out


# -- Stripe's behaviour, as pure functions ---------------------------------------------------

@dataclass(frozen=True)
class Backoff:
    """Stripe's redelivery schedule, time-compressed: exponential, capped, bounded in attempts.

    ``delay_s(n)`` is the wait after the n-th failed attempt of an event:
    ``min(cap_s, base_s * 2**(n-1))``, shortened by up to ``jitter`` (a fraction) at random.
    """
    base_s: float = 0.5
    cap_s: float = 8.0
    max_attempts: int = 6
    jitter: float = 0.0

    def __post_init__(self):
        if self.base_s < 0 or self.cap_s < 0 or self.max_attempts < 1 or not 0 <= self.jitter <= 1:
            raise ValueError("Backoff needs base_s, cap_s >= 0, max_attempts >= 1 and 0 <= jitter <= 1")

    def delay_s(self, failed_attempts: int, rng: random.Random | None = None) -> float:
        delay = min(self.cap_s, self.base_s * 2 ** (max(failed_attempts, 1) - 1))
        if self.jitter:
            delay *= 1 - self.jitter * (rng or random).random()
        return delay

    def gives_up_after(self, failed_attempts: int) -> bool:
        return failed_attempts >= self.max_attempts

    def schedule(self) -> list[float]:
        """Delays between the attempts of an event that is never acknowledged (without jitter)."""
        return [min(self.cap_s, self.base_s * 2 ** (n - 1)) for n in range(1, self.max_attempts)]


def delivery_order(events: Sequence[SimEvent], *, reverse: bool = False, shuffle_window: int = 0,
                   rng: random.Random | None = None) -> list[SimEvent]:
    """The order in which Stripe sends ``events``: as given, reversed, or shuffled within a window.

    A window of w moves no event w or more places away from its position (each event
    is sorted by its index plus a uniform offset in [0, w)); w <= 1 keeps the order.
    """
    ordered = list(reversed(events)) if reverse else list(events)
    if shuffle_window > 1:
        rng = rng or random.Random()
        keys = [i + rng.uniform(0, shuffle_window - 1) for i in range(len(ordered))]
        ordered = [evt for _, evt in sorted(zip(keys, ordered), key=lambda pair: pair[0])]
    return ordered


@dataclass(frozen=True)
class Send:
    """One planned delivery: the event, why it is sent, and how many copies go at once."""
    event: SimEvent
    kind: str = FIRST
    copies: int = 1


def plan(events: Sequence[SimEvent], *, reverse: bool = False, shuffle_window: int = 0,
         duplicates: float = 0.0, concurrent_duplicates: float = 0.0, concurrent_copies: int = 2,
         rng: random.Random | None = None) -> list[Send]:
    """Every first delivery of a run, in sending order, with the spontaneous duplicates put in.

    ``round(duplicates * n)`` events, picked at random, get one more delivery placed
    at a random position after their first one; ``round(concurrent_duplicates * n)``
    others are sent as ``concurrent_copies`` copies released together.
    """
    if not 0 <= duplicates <= 1 or not 0 <= concurrent_duplicates <= 1:
        raise ValueError("duplicate fractions must be between 0 and 1")
    rng = rng or random.Random()
    ordered = delivery_order(events, reverse=reverse, shuffle_window=shuffle_window, rng=rng)
    n = len(ordered)
    together = set(rng.sample(range(n), round(concurrent_duplicates * n)))
    keyed = [(float(i), Send(evt, CONCURRENT, max(2, concurrent_copies)) if i in together else Send(evt))
             for i, evt in enumerate(ordered)]
    # A duplicate goes anywhere after its first delivery (key in (i + 0.5, n)), last included.
    keyed += [(rng.uniform(i + 0.5, n), Send(ordered[i], DUPLICATE))
              for i in rng.sample(range(n), round(duplicates * n))]
    return [send for _, send in sorted(keyed, key=lambda pair: pair[0])]


# -- the wire ---------------------------------------------------------------------------------

class Transport(Protocol):
    def __call__(self, body: bytes, headers: dict[str, str], timeout_s: float) -> tuple[int, bytes]:
        """POST ``body``; the HTTP status and body of the answer. Raises OSError (TimeoutError) on failure."""


@dataclass(frozen=True)
class HttpTransport:
    """POST to a URL with http.client, one connection per request (safe from any thread)."""
    url: str

    def __call__(self, body: bytes, headers: dict[str, str], timeout_s: float) -> tuple[int, bytes]:
        parts = urlsplit(self.url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname, parts.port, timeout=timeout_s)
        try:
            conn.request("POST", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), body=body,
                         headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        except http.client.HTTPException as exc:  # a broken answer is no answer
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from None
        finally:
            conn.close()


@dataclass(frozen=True)
class Answer:
    """What one delivery attempt got back."""
    event_id: str
    delivery: int           # 1 for the event's first delivery, 2 for the next one, ...
    kind: str               # FIRST, RETRY, DUPLICATE, CONCURRENT or MANUAL
    status: int | None      # None: timed out or could not connect
    outcome: dict | None    # the JSON answer, when there was one
    error: str | None       # why there was no answer
    sent_at: float          # on the simulator's clock
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


@dataclass(frozen=True)
class Summary:
    events: int
    deliveries: int
    non_2xx: int
    redeliveries: int
    duplicates: int
    gave_up: int
    elapsed_s: float

    def line(self) -> str:
        return (f"events={self.events} deliveries={self.deliveries} non_2xx={self.non_2xx} "
                f"redeliveries={self.redeliveries} duplicates={self.duplicates} gave_up={self.gave_up} "
                f"elapsed={self.elapsed_s:.2f}s")


# -- the simulator ----------------------------------------------------------------------------

@dataclass
class StripeSimulator:
    """Delivers events to a receiver the way Stripe does, and remembers every answer.

    Give ``url`` (HTTP) or ``transport`` (anything that POSTs; tests use fakes).
    ``clock``/``sleep``/``wall_clock`` are injectable so the schedule can be
    checked without waiting.
    """
    url: str | None = None
    secret: str = ""
    backoff: Backoff = field(default_factory=Backoff)
    timeout_s: float = 10.0
    seed: int | None = None
    transport: Transport | None = None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    wall_clock: Callable[[], float] = time.time
    answers: dict[str, list[Answer]] = field(default_factory=dict, init=False)

    def __post_init__(self):
        if self.transport is None:
            if not self.url:
                raise ValueError("StripeSimulator needs a url or a transport")
            self.transport = HttpTransport(self.url)
        if not self.secret:
            raise ValueError("StripeSimulator needs the endpoint's signing secret (whsec_...)")
        self.rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._gave_up: set[str] = set()
        self._started = self.clock()

    # one attempt --------------------------------------------------------------------------
    def headers_for(self, body: str) -> dict[str, str]:
        """Stripe's request headers for this body, signed now (each attempt is signed afresh)."""
        return {"Content-Type": "application/json; charset=utf-8", "User-Agent": USER_AGENT,
                "Stripe-Signature": sign(body, self.secret, timestamp=int(self.wall_clock()))}

    def send(self, event: SimEvent, kind: str = MANUAL) -> Answer:
        """One delivery attempt of ``event``, recorded; no redelivery."""
        headers = self.headers_for(event.body)
        with self._lock:
            delivery = len(self.answers.setdefault(event.id, [])) + 1
            # Reserve the slot now, so concurrent copies get distinct numbers.
            self.answers[event.id].append(None)  # type: ignore[arg-type]
        started = self.clock()
        status = outcome = error = None
        try:
            status, raw = self.transport(event.body.encode("utf-8"), headers, self.timeout_s)
            try:
                parsed = json.loads(raw)
                outcome = parsed if isinstance(parsed, dict) else None
            except ValueError:
                outcome = None
        except TimeoutError:
            error = "timeout"
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
        answer = Answer(event.id, delivery, kind, status, outcome, error, started - self._started,
                        self.clock() - started)
        with self._lock:
            self.answers[event.id][delivery - 1] = answer
        return answer

    def send_concurrently(self, event: SimEvent, copies: int, kind: str = CONCURRENT) -> list[Answer]:
        """``copies`` deliveries of ``event`` from as many threads, released at the same moment."""
        return run_together(lambda _: self.send(event, kind), copies)

    # Stripe's loop ------------------------------------------------------------------------
    def deliver(self, event: SimEvent) -> list[Answer]:
        """Deliver one event (as a first delivery) until acknowledged or Stripe gives up; the answers it got."""
        before = len(self.answers.get(event.id, []))
        self.run([event])
        return self.answers[event.id][before:]

    def run(self, events: Sequence[SimEvent], *, reverse: bool = False, shuffle_window: int = 0,
            duplicates: float = 0.0, concurrent_duplicates: float = 0.0, concurrent_copies: int = 2,
            interval_s: float = 0.0) -> Summary:
        """Deliver ``events`` as Stripe would; returns the summary of everything sent so far.

        First deliveries go out in the planned order, ``interval_s`` apart; a
        delivery that is not acknowledged is redelivered after the backoff,
        interleaved by due time with the rest, until acknowledged or given up.
        """
        sends = plan(events, reverse=reverse, shuffle_window=shuffle_window, duplicates=duplicates,
                     concurrent_duplicates=concurrent_duplicates, concurrent_copies=concurrent_copies,
                     rng=self.rng)
        start = self.clock()
        seq = itertools.count()
        due: list[tuple[float, int, Send, int]] = [(start + i * interval_s, next(seq), s, 0)
                                                   for i, s in enumerate(sends)]
        heapq.heapify(due)
        while due:
            at, _, planned, failed = heapq.heappop(due)
            wait = at - self.clock()
            if wait > 0:
                self.sleep(wait)
            if planned.copies > 1:
                got = self.send_concurrently(planned.event, planned.copies, planned.kind)
            else:
                got = [self.send(planned.event, planned.kind)]
            if any(a.ok for a in got):
                continue
            failed += 1
            if self.backoff.gives_up_after(failed):
                with self._lock:
                    self._gave_up.add(planned.event.id)
                continue
            retry_at = self.clock() + self.backoff.delay_s(failed, self.rng)
            heapq.heappush(due, (retry_at, next(seq), Send(planned.event, RETRY), failed))
        return self.summary()

    # what happened ------------------------------------------------------------------------
    def answers_for(self, event_id: str) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers.get(event_id, []) if a is not None]

    def last(self, event_id: str) -> Answer:
        return self.answers_for(event_id)[-1]

    def statuses(self, event_id: str) -> list[int | None]:
        return [a.status for a in self.answers_for(event_id)]

    def outcomes(self, event_id: str) -> list[str | None]:
        return [(a.outcome or {}).get("outcome") for a in self.answers_for(event_id)]

    @property
    def gave_up(self) -> set[str]:
        with self._lock:
            return set(self._gave_up)

    def summary(self) -> Summary:
        with self._lock:
            every = [a for answers in self.answers.values() for a in answers if a is not None]
            gave_up = len(self._gave_up)
        redeliveries = sum(a.kind == RETRY for a in every)
        return Summary(events=len(self.answers), deliveries=len(every),
                       non_2xx=sum(not a.ok for a in every), redeliveries=redeliveries,
                       # Every delivery beyond an event's first that no failure asked for.
                       duplicates=len(every) - len(self.answers) - redeliveries,
                       gave_up=gave_up, elapsed_s=self.clock() - self._started)

    def report(self) -> dict:
        """Every answer, per event id, as plain data (for logs and benchmark records)."""
        with self._lock:
            return {event_id: [asdict(a) for a in answers if a is not None]
                    for event_id, answers in self.answers.items()}


# -- command line -----------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devkit.stripe_sim",
                                     description="Deliver Stripe events to a receiver the way Stripe does.")
    parser.add_argument("--url", required=True, help="the receiver's webhook URL")
    parser.add_argument("--secret", default=os.environ.get("STRIPE_WEBHOOK_SECRET", "").split(",")[-1].strip(),
                        help="signing secret (default: the last of $STRIPE_WEBHOOK_SECRET)")
    parser.add_argument("--lifecycles", type=int, default=1, help="generated subscription lifecycles")
    parser.add_argument("--basil", action="store_true", help="generate basil-era (2025-03-31) payloads")
    parser.add_argument("--fixtures", nargs="?", const=str(DEFAULT_FIXTURES_DIR), default=None,
                        help="also send every event file of this directory (default: the shared fixtures)")
    parser.add_argument("--duplicates", type=float, default=0.0, help="fraction of events sent twice")
    parser.add_argument("--concurrent", type=float, default=0.0,
                        help="fraction of events sent as simultaneous copies")
    parser.add_argument("--copies", type=int, default=2, help="copies per simultaneous delivery")
    parser.add_argument("--shuffle", action="store_true", help="shuffle the order within a window")
    parser.add_argument("--window", type=int, default=5, help="shuffle window (events)")
    parser.add_argument("--reverse", action="store_true", help="send every history backwards")
    parser.add_argument("--base", type=float, default=0.5, help="first redelivery delay, seconds")
    parser.add_argument("--cap", type=float, default=8.0, help="longest redelivery delay, seconds")
    parser.add_argument("--max-attempts", type=int, default=6, help="attempts before Stripe gives up")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    if not args.secret:
        parser.error("--secret (or STRIPE_WEBHOOK_SECRET) is required")

    events = lifecycle_events(args.lifecycles, api_version=BASIL_API if args.basil else OLD_API,
                              start=int(time.time()) - 86400)
    if args.fixtures is not None:
        events += fixture_events(args.fixtures)
    sim = StripeSimulator(url=args.url, secret=args.secret, timeout_s=args.timeout, seed=args.seed,
                          backoff=Backoff(base_s=args.base, cap_s=args.cap, max_attempts=args.max_attempts))
    summary = sim.run(events, reverse=args.reverse, shuffle_window=args.window if args.shuffle else 0,
                      duplicates=args.duplicates, concurrent_duplicates=args.concurrent,
                      concurrent_copies=args.copies)
    print(json.dumps(asdict(summary)) if args.json else summary.line(), flush=True)
    return 0 if summary.gave_up == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
