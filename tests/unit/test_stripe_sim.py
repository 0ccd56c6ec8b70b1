"""The Stripe delivery simulator's own logic, on a fake clock and a fake wire (no receiver, no waiting)."""
from __future__ import annotations

import json
import random
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import stripe
from hypothesis import given, settings as hypothesis_settings, strategies as st

from devkit import stripe_sim
from devkit.stripe_sim import (CONCURRENT, DUPLICATE, FIRST, MANUAL, RETRY, Backoff, SimEvent, StripeSimulator,
                            delivery_order, fixture_events, lifecycle_events, plan)
from tests.support.constants import FIXTURES_DIR

SECRET = "whsec_sim_unit_tests_0123"


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class FakeWire:
    """Answers per event id from a script (status, or an exception), then 200; remembers what it got."""

    def __init__(self, clock: FakeClock, script: dict[str, list] | None = None, latency_s: float = 0.0):
        self.clock = clock
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.latency_s = latency_s
        self.received: list[tuple[float, str, dict]] = []
        self._lock = threading.Lock()

    def __call__(self, body: bytes, headers: dict, timeout_s: float):
        event_id = json.loads(body)["id"]
        with self._lock:
            self.received.append((self.clock.now, event_id, headers))
            planned = self.script.get(event_id, [])
            result = planned.pop(0) if planned else 200
            self.clock.now += self.latency_s
        if isinstance(result, BaseException):
            raise result
        return result, json.dumps({"outcome": "received" if result == 200 else "error", "event_id": event_id}).encode()


def simulator(script=None, *, backoff=Backoff(base_s=1.0, cap_s=8.0, max_attempts=5), latency_s=0.0, seed=1):
    clock = FakeClock()
    wire = FakeWire(clock, script, latency_s)
    sim = StripeSimulator(secret=SECRET, transport=wire, backoff=backoff, seed=seed, clock=clock,
                          sleep=clock.sleep, wall_clock=lambda: 1_750_000_000 + clock.now)
    return sim, wire, clock


def events(n: int) -> list[SimEvent]:
    return [SimEvent(id=f"evt_{i:03d}", type="test.effect", body=json.dumps({"id": f"evt_{i:03d}", "n": i}))
            for i in range(n)]


# -- backoff ----------------------------------------------------------------------------------------

def test_the_backoff_doubles_from_the_base_up_to_the_cap_and_stops_after_max_attempts():
    backoff = Backoff(base_s=0.5, cap_s=3.0, max_attempts=7)
    assert backoff.schedule() == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert [backoff.delay_s(n) for n in (1, 2, 3, 4, 10)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert not backoff.gives_up_after(6) and backoff.gives_up_after(7)


def test_jitter_only_ever_shortens_a_delay():
    backoff = Backoff(base_s=1.0, cap_s=16.0, max_attempts=9, jitter=0.5)
    rng = random.Random(3)
    for n in range(1, 9):
        for _ in range(50):
            assert 0.5 * backoff.schedule()[n - 1] <= backoff.delay_s(n, rng) <= backoff.schedule()[n - 1]


@pytest.mark.parametrize("bad", [dict(base_s=-1), dict(max_attempts=0), dict(jitter=1.5)])
def test_a_backoff_that_makes_no_sense_is_refused(bad):
    with pytest.raises(ValueError):
        Backoff(**bad)


# -- redelivery ---------------------------------------------------------------------------------------

def test_a_failing_event_is_redelivered_on_the_backoff_schedule_until_acknowledged():
    sim, wire, clock = simulator({"evt_000": [500, 503, TimeoutError("timed out"), 200]})
    summary = sim.run(events(1))
    sent = [t - 1000.0 for t, _, _ in wire.received]
    assert sent == [0.0, 1.0, 3.0, 7.0]  # 1, 2, 4 s after each failure
    answers = sim.answers_for("evt_000")
    assert [(a.kind, a.status, a.error) for a in answers] == [
        (FIRST, 500, None), (RETRY, 503, None), (RETRY, None, "timeout"), (RETRY, 200, None)]
    assert [a.delivery for a in answers] == [1, 2, 3, 4]
    assert answers[-1].outcome == {"outcome": "received", "event_id": "evt_000"}
    assert (summary.events, summary.deliveries, summary.non_2xx, summary.redeliveries, summary.duplicates,
            summary.gave_up) == (1, 4, 3, 3, 0, 0)


def test_stripe_gives_up_after_max_attempts():
    sim, wire, _ = simulator({"evt_000": [500] * 10}, backoff=Backoff(base_s=1.0, cap_s=2.0, max_attempts=4))
    summary = sim.run(events(1))
    assert sim.statuses("evt_000") == [500] * 4
    assert [t - 1000.0 for t, _, _ in wire.received] == [0.0, 1.0, 3.0, 5.0]
    assert sim.gave_up == {"evt_000"} and summary.gave_up == 1


def test_any_non_2xx_and_any_connection_failure_is_redelivered_and_2xx_is_not():
    script = {"evt_000": [400, 200], "evt_001": [ConnectionRefusedError("refused"), 204],
              "evt_002": [302, 200], "evt_003": [201]}
    sim, _, _ = simulator(script)
    sim.run(events(4))
    assert sim.statuses("evt_000") == [400, 200]
    assert sim.statuses("evt_001") == [None, 204]
    assert "ConnectionRefusedError" in sim.answers_for("evt_001")[0].error
    assert sim.statuses("evt_002") == [302, 200]
    assert sim.statuses("evt_003") == [201]


def test_redeliveries_interleave_with_the_other_events_by_due_time():
    # First deliveries go out 1 s apart; evt_000's retry is due 1.5 s after its failure.
    sim, wire, _ = simulator({"evt_000": [500]}, backoff=Backoff(base_s=1.5, cap_s=10, max_attempts=3))
    sim.run(events(3), interval_s=1.0)
    assert [(t - 1000.0, e) for t, e, _ in wire.received] == [
        (0.0, "evt_000"), (1.0, "evt_001"), (1.5, "evt_000"), (2.0, "evt_002")]


def test_a_slow_answer_delays_the_next_delivery_but_not_the_retry_schedule_of_others():
    sim, wire, _ = simulator({"evt_000": [500]}, latency_s=0.25, backoff=Backoff(base_s=0.1, cap_s=1, max_attempts=3))
    sim.run(events(2))
    # evt_000 fails at 0.25 (answer time); its retry is due at 0.35, after evt_001 (sent at 0.25, answered 0.5).
    assert [(round(t - 1000.0, 2), e) for t, e, _ in wire.received] == [
        (0.0, "evt_000"), (0.25, "evt_001"), (0.5, "evt_000")]


# -- signing ------------------------------------------------------------------------------------------

def test_every_attempt_is_signed_afresh_the_way_stripe_signs_and_verifies():
    sim, wire, clock = simulator({"evt_000": [500, 200]})
    sim.run(events(1))
    (t1, _, h1), (t2, _, h2) = wire.received
    body = events(1)[0].body
    for t, headers in ((t1, h1), (t2, h2)):
        assert headers["Stripe-Signature"].startswith(f"t={int(1_750_000_000 + t)},v1=")
        assert headers["Content-Type"].startswith("application/json")
        stripe.WebhookSignature.verify_header(body, headers["Stripe-Signature"], SECRET, tolerance=None)
    with pytest.raises(stripe.SignatureVerificationError):
        stripe.WebhookSignature.verify_header(body, h1["Stripe-Signature"], "whsec_someone_else", tolerance=None)


# -- order and duplicates -------------------------------------------------------------------------------

@hypothesis_settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), window=st.integers(0, 8), seed=st.integers(0, 2**32))
def test_a_windowed_shuffle_is_a_permutation_moving_no_event_window_places_or_more(n, window, seed):
    evts = events(n)
    ordered = delivery_order(evts, shuffle_window=window, rng=random.Random(seed))
    assert sorted(e.id for e in ordered) == [e.id for e in evts]
    for position, evt in enumerate(ordered):
        assert abs(position - evts.index(evt)) < max(window, 1)


def test_a_window_actually_shuffles_and_reverse_reverses():
    evts = events(30)
    assert delivery_order(evts, shuffle_window=1, rng=random.Random(1)) == evts
    assert delivery_order(evts, shuffle_window=5, rng=random.Random(1)) != evts
    assert delivery_order(evts, reverse=True) == evts[::-1]


@hypothesis_settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), duplicates=st.floats(0, 1), together=st.floats(0, 1), seed=st.integers(0, 2**32))
def test_a_plan_sends_every_event_once_plus_its_duplicates_each_after_its_first_delivery(n, duplicates, together,
                                                                                       seed):
    evts = events(n)
    sends = plan(evts, duplicates=duplicates, concurrent_duplicates=together, concurrent_copies=3,
                 rng=random.Random(seed))
    firsts = [s for s in sends if s.kind in (FIRST, CONCURRENT)]
    assert sorted(s.event.id for s in firsts) == [e.id for e in evts]
    dups = [s for s in sends if s.kind == DUPLICATE]
    assert len(dups) == round(duplicates * n) and len({s.event.id for s in dups}) == len(dups)
    assert sum(s.kind == CONCURRENT for s in sends) == round(together * n)
    assert all(s.copies == 3 for s in sends if s.kind == CONCURRENT)
    for dup in dups:
        assert sends.index(dup) > next(i for i, s in enumerate(sends) if s.event is dup.event and s.kind != DUPLICATE)


def test_a_run_with_duplicates_and_simultaneous_copies_counts_them_and_records_every_answer():
    sim, wire, _ = simulator()
    summary = sim.run(events(20), duplicates=0.25, concurrent_duplicates=0.1, concurrent_copies=4)
    per_event = Counter(e for _, e, _ in wire.received)
    assert sum(per_event.values()) == 20 + 5 + 2 * 3
    assert (summary.events, summary.deliveries, summary.redeliveries, summary.duplicates, summary.non_2xx) == (
        20, 31, 0, 11, 0)
    for event_id, n in per_event.items():
        assert [a.delivery for a in sim.answers_for(event_id)] == list(range(1, n + 1))


def test_simultaneous_copies_are_released_together_from_threads():
    in_flight = threading.Barrier(6, timeout=30)  # passes only once all six copies are in flight at once
    seen = []

    def wire(body, headers, timeout_s):
        seen.append(threading.get_ident())
        in_flight.wait()
        return 200, b'{"outcome": "duplicate"}'

    sim = StripeSimulator(secret=SECRET, transport=wire)
    answers = sim.send_concurrently(events(1)[0], 6)
    assert len(answers) == 6 and len(set(seen)) == 6
    assert sorted(a.delivery for a in answers) == [1, 2, 3, 4, 5, 6]
    assert {a.kind for a in answers} == {CONCURRENT} and all(a.ok for a in answers)


def test_sending_again_by_hand_is_recorded_as_manual_and_deliver_returns_only_its_own_answers():
    sim, _, _ = simulator({"evt_000": [500, 200]})
    first = sim.deliver(events(1)[0])
    assert [(a.kind, a.status) for a in first] == [(FIRST, 500), (RETRY, 200)]
    again = sim.send(events(1)[0])
    assert (again.kind, again.delivery, again.ok) == (MANUAL, 3, True)
    assert sim.summary().duplicates == 1


# -- payloads ------------------------------------------------------------------------------------------

def test_generated_lifecycles_are_stripe_events_in_created_order():
    evts = lifecycle_events(2)
    assert len(evts) == 20 and len({e.id for e in evts}) == 20
    types = [e.type for e in evts[:10]]
    assert types[0] == "customer.created" and types[-1] == "customer.subscription.deleted"
    assert all(a.created < b.created for a, b in zip(evts[:10], evts[1:10]))
    assert json.loads(evts[3].body)["id"] == evts[3].id


def test_with_id_changes_only_the_event_id_characters_of_the_body():
    original = SimEvent.from_text('{\n  "id": "evt_1",\n  "data": {"object": {"id": "ch_1"}},\n  "type": "x.y"\n}')
    renamed = original.with_id("evt_1_abc")
    assert renamed.body == original.body.replace('"evt_1"', '"evt_1_abc"')
    assert renamed.data["data"]["object"]["id"] == "ch_1"


@pytest.mark.skipif(not FIXTURES_DIR.is_dir(), reason=f"no fixture events in {FIXTURES_DIR}")
def test_fixture_events_keep_their_bytes_and_get_ids_of_their_own():
    evts = fixture_events(FIXTURES_DIR)
    files = sorted(FIXTURES_DIR.glob("*.json"))
    assert len(evts) == len(files) and len({e.id for e in evts}) == len(evts)
    for evt, path in zip(evts, files):
        text = path.read_text(encoding="utf-8")
        original = json.loads(text)["id"]
        assert evt.id.startswith(original + "_") and evt.body == text.replace(f'"{original}"', f'"{evt.id}"', 1)
    assert {e.type for e in fixture_events(FIXTURES_DIR, types=["charge.refunded"])} == {"charge.refunded"}


def test_an_absent_fixture_directory_gives_no_events(tmp_path):
    assert fixture_events(tmp_path / "nowhere") == []


# -- over real HTTP, and the command line -------------------------------------------------------------------

class _Receiver(BaseHTTPRequestHandler):
    """Answers 500 to the first delivery of every third event id, 200 after; checks every signature."""
    seen: Counter = Counter()

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        stripe.WebhookSignature.verify_header(body, self.headers["Stripe-Signature"], SECRET, 300)
        event_id = json.loads(body)["id"]
        _Receiver.seen[event_id] += 1
        fail = _Receiver.seen[event_id] == 1 and int(event_id[-1], 16) % 3 == 0
        answer = json.dumps({"outcome": "error" if fail else "received"}).encode()
        self.send_response(500 if fail else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def test_the_command_line_delivers_lifecycles_over_http_and_prints_one_summary_line(capsys):
    _Receiver.seen = Counter()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        code = stripe_sim.main(["--url", f"http://127.0.0.1:{server.server_port}/webhooks/stripe",
                                "--secret", SECRET, "--lifecycles", "2", "--duplicates", "0.2", "--shuffle",
                                "--base", "0.01", "--cap", "0.05", "--seed", "7"])
    finally:
        server.shutdown()
        server.server_close()
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(out) == 1
    fields = dict(part.split("=") for part in out[0].split())
    failed_first = sum(1 for event_id in _Receiver.seen if int(event_id[-1], 16) % 3 == 0)
    assert int(fields["events"]) == 20 and int(fields["duplicates"]) == 4
    assert int(fields["non_2xx"]) == int(fields["redeliveries"]) == failed_first
    assert int(fields["deliveries"]) == 20 + 4 + failed_first == sum(_Receiver.seen.values())
    assert fields["gave_up"] == "0"
