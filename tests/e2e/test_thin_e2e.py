"""Thin event notifications with real processes: the receiver (gunicorn) records what Stripe POSTs to
/webhooks/stripe/thin, real ``celery`` workers (built-in handlers only) fetch what each notification points
at from the fake Stripe API (devkit.stripe_api, served from the test process over HTTP).

Every test first POSTs with the receiver alone running, its environment holding the API key and base
(it could reach the fake if it ever tried), and checks that nothing reached the fake and every row is
``received``: the receiver never calls Stripe. Only then do workers start.
(In-process: tests/integration/test_thin_events.py.)
"""
from __future__ import annotations

import collections
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

from devkit.factories import SubscriptionHistory, body_of, health_event, sign, thin_twin, v2_event
from devkit.procs import free_port, wait_until
from tests.support.constants import WEBHOOK_SECRET
from tests.support.receiver import receiver_env
from tests.support.stripe_api import env_of, fake_stripe  # noqa: F401
from tests.support.workers import json_lines

THIN_SECRET = "whsec_test_thin_0123456789"
BUILT_IN_ONLY: tuple[str, ...] = ()
HEALTH_LINE = "stripe failed to generate an event"
# A subscription row as business state: the ordering key's columns differ by design (a thin notification
# has its own id and a millisecond created).
SUBSCRIPTION_COLUMNS = ("id, customer_id, status, price_id, product_id, quantity, cancel_at_period_end, "
                        "current_period_start, current_period_end, trial_end, canceled_at, ended_at, features, "
                        "account, livemode")


# -- the stack --------------------------------------------------------------------------------

def start_receiver_alone(start_receiver, settings, fake):
    """The receiver with both endpoints' secrets and the API's key and base in its environment."""
    return start_receiver(receiver_env(settings.database_url, settings.broker_url, WEBHOOK_SECRET,
                                       LEDGER_QUEUE=settings.queue_name, STRIPE_THIN_WEBHOOK_SECRET=THIN_SECRET,
                                       **env_of(fake)), workers=2)


def start_workers(configured_worker_factory, settings, fake, n: int = 1, *, concurrency: int = 1,
                  env: dict[str, str] | None = None):
    """``n`` worker processes started together (built-in handlers only), each ready."""
    workers = [configured_worker_factory(settings, handler_modules=BUILT_IN_ONLY, concurrency=concurrency,
                                         env={**env_of(fake), **(env or {})}, label=f"thin{i}", ready=False)
               for i in range(n)]
    for worker in workers:
        worker.wait_ready()
    return workers


def post(receiver, evt: dict, *, thin: bool) -> None:
    body = body_of(evt)
    secret, path = (THIN_SECRET, "/webhooks/stripe/thin") if thin else (WEBHOOK_SECRET, "/webhooks/stripe")
    answer = receiver.post(body.encode(), {"Stripe-Signature": sign(body, secret)}, path=path)
    assert answer.status_code == 200, (evt["id"], answer.status_code, answer.body)


def post_concurrently(receiver, evts: list[dict], *, thin: bool, threads: int = 6) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda evt: post(receiver, evt, thin=thin), evts))


def assert_recorded_without_any_api_call(kit, fake, evts: list[dict]) -> None:
    """The receiver's side of every test, checked while no worker runs."""
    assert fake.requests == []
    ids = [evt["id"] for evt in evts]
    statuses = {r["id"]: r["status"] for r in kit.query("SELECT id, status FROM ledger.events WHERE id = ANY(%s)",
                                                        (ids,))}
    assert statuses == {event_id: "received" for event_id in ids}


# -- the ledger and billing, as data ----------------------------------------------------------

def wait_processed(kit, ids, timeout_s: float = 30) -> None:
    ids = sorted(set(ids))

    def done():
        rows = kit.query("SELECT status, count(*) AS n FROM ledger.events WHERE id = ANY(%s) GROUP BY status",
                         (ids,))
        return {r["status"]: r["n"] for r in rows} == {"processed": len(ids)}
    wait_until(done, timeout_s=timeout_s, interval_s=0.1, what=f"{len(ids)} events to be processed (now "
               f"{kit.query('SELECT status, failure_reason, count(*) FROM ledger.events GROUP BY 1, 2')})")


def attempt_outcomes(kit) -> dict[str, list[str]]:
    outcomes: dict[str, list[str]] = collections.defaultdict(list)
    for row in kit.query("SELECT event_id, outcome FROM ledger.attempts ORDER BY event_id, attempt"):
        outcomes[row["event_id"]].append(row["outcome"])
    return dict(outcomes)


def billing_state(kit) -> tuple[list[dict], list[dict]]:
    return (kit.query(f"SELECT {SUBSCRIPTION_COLUMNS} FROM billing.subscriptions ORDER BY id"),
            kit.query("SELECT customer_id, feature, source FROM billing.entitlements ORDER BY 1, 2"))


def thin_of(fake, evt: dict) -> dict:
    """The thin notification of snapshot event ``evt``, its v2 event at the fake naming ``evt`` as its
    snapshot event, as Stripe's does."""
    note = thin_twin(evt)
    fake.add_v2_event({**v2_event(note), "snapshot_event": evt["id"]})
    return note


def fetch_paths(note: dict) -> tuple[str, str]:
    """What an attempt at a v1 notification GETs, in order: its v2 event, then its object."""
    return f"/v2/core/events/{note['id']}", note["related_object"]["url"]


def history_with_current_state(fake, start: int) -> SubscriptionHistory:
    """A lifecycle whose last subscription, customer and invoice states are what the fake API answers now."""
    history = SubscriptionHistory(start=start)
    history.lifecycle()
    for evt in history.events:
        fake.put_object(evt["data"]["object"])
    return history


def scrape(port: int) -> dict[tuple[str, frozenset], float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# -- the tests --------------------------------------------------------------------------------

def test_a_lifecycle_sent_thin_twice_concurrently_is_processed_once_and_gives_the_snapshot_rows(
        kit, broker_settings, start_receiver, configured_worker_factory, fake_stripe):
    settings = broker_settings
    history = history_with_current_state(fake_stripe, int(time.time()) - 3600)
    notes = [thin_of(fake_stripe, evt) for evt in history.events]
    deliveries = notes * 2
    random.Random(14).shuffle(deliveries)

    receiver = start_receiver_alone(start_receiver, settings, fake_stripe)
    post_concurrently(receiver, deliveries, thin=True)
    assert_recorded_without_any_api_call(kit, fake_stripe, notes)

    start_workers(configured_worker_factory, settings, fake_stripe, 2)
    wait_processed(kit, [n["id"] for n in notes])
    # Exactly once: each notification has one processed attempt; any other attempt failed recoverably
    # and rolled back (under load two workers' transactions on one customer can meet in a deadlock, or a
    # fetch can time out: retried as any event's). Each attempt fetched what its notification named, once.
    outcomes = attempt_outcomes(kit)
    assert {event_id: attempts.count("processed") for event_id, attempts in outcomes.items()} == {
        n["id"]: 1 for n in notes}
    retried = kit.query("SELECT event_id, error FROM ledger.attempts WHERE outcome <> 'processed'")
    assert all(attempts[-1] == "processed" and set(attempts[:-1]) <= {"failed_recoverable"}
               for attempts in outcomes.values()), (outcomes, retried)
    assert {n["id"]: kit.deliveries(n["id"]) for n in notes} == {n["id"]: 2 for n in notes}
    assert collections.Counter(r.path for r in fake_stripe.requests) == collections.Counter(
        path for n in notes for _ in outcomes[n["id"]] for path in fetch_paths(n))
    from_thin = billing_state(kit)
    assert [r["status"] for r in from_thin[0]] == ["canceled"]

    # The same lifecycle as snapshot events, through the same receiver and workers, one after another.
    kit.wipe()
    for evt in history.events:
        post(receiver, evt, thin=False)
        wait_processed(kit, [evt["id"]])
    assert billing_state(kit) == from_thin


def test_an_api_outage_mid_fetch_is_retried_on_our_schedule_after_retry_after_and_processed_once(
        kit, broker_settings, start_receiver, configured_worker_factory, fake_stripe):
    settings = broker_settings
    start = int(time.time()) - 3600
    histories = [history_with_current_state(fake_stripe, start + n) for n in range(6)]
    before = [thin_of(fake_stripe, h.events[0]) for h in histories]   # customer.created: /v1/customers/...
    during = [thin_of(fake_stripe, h.events[-1]) for h in histories]  # subscription.deleted: /v1/subscriptions/...

    receiver = start_receiver_alone(start_receiver, settings, fake_stripe)
    post_concurrently(receiver, before, thin=True)
    assert_recorded_without_any_api_call(kit, fake_stripe, before)
    start_workers(configured_worker_factory, settings, fake_stripe, concurrency=2)
    wait_processed(kit, [n["id"] for n in before])
    fetched_before = len(fake_stripe.requests)

    # The API goes down in the middle of the fetches: 3 x 503, then 3 x 429 asking for a second's wait.
    fake_stripe.fail_next(3, status=503)
    fake_stripe.fail_next(3, status=429, retry_after=1)
    post_concurrently(receiver, during, thin=True)
    wait_processed(kit, [n["id"] for n in during])

    requests = list(enumerate(fake_stripe.requests))[fetched_before:]
    assert sorted(r.status for _, r in requests if r.status != 200) == [429] * 3 + [503] * 3
    outcomes = attempt_outcomes(kit)
    for note in during:
        tries = [(fake_stripe.arrived_at[i], r.status, r.path) for i, r in requests if r.path in fetch_paths(note)]
        failed = [(status, path) for _, status, path in tries if status != 200]
        # Each failed request (of the v2 event or of the object) was one failed attempt; the last attempt
        # fetched both and processed it, once.
        assert [(status, path) for _, status, path in tries[-2:]] == [(200, p) for p in fetch_paths(note)], tries
        assert {status for status, _ in failed} <= {429, 503}, tries
        assert outcomes[note["id"]] == ["failed_recoverable"] * len(failed) + ["processed"], (note["id"], tries)
        errors = [a["error"] for a in kit.attempts(note["id"])[:-1]]
        assert all(f"{path}: {status} " in error
                   for error, (status, path) in zip(errors, failed, strict=True)), errors
        for (failed_at, status, _), (retried_at, _, _) in zip(tries, tries[1:]):
            if status == 429:
                assert retried_at - failed_at >= 1.0, tries    # never sooner than Stripe's Retry-After
    assert sum(len(v) - 1 for v in outcomes.values()) == 6
    assert kit.query("SELECT count(*) AS n FROM ledger.deliveries")[0]["n"] == len(before) + len(during)
    assert {r["status"] for r in billing_state(kit)[0]} == {"canceled"}
    assert len(billing_state(kit)[0]) == len(histories)


def test_a_health_event_repairs_the_object_whose_event_stripe_never_sent_and_is_alerted_once(
        kit, broker_settings, start_receiver, configured_worker_factory, fake_stripe, tmp_path):
    settings = broker_settings
    history = history_with_current_state(fake_stripe, int(time.time()) - 3600)
    *sent, never_sent = history.events    # customer.subscription.deleted: Stripe failed to generate it
    subscription = never_sent["data"]["object"]

    receiver = start_receiver_alone(start_receiver, settings, fake_stripe)
    post_concurrently(receiver, sent, thin=False)
    assert_recorded_without_any_api_call(kit, fake_stripe, sent)
    first = start_workers(configured_worker_factory, settings, fake_stripe)[0]
    wait_processed(kit, [evt["id"] for evt in sent])
    [row] = kit.query("SELECT status, cancel_at_period_end FROM billing.subscriptions")
    assert row == {"status": "active", "cancel_at_period_end": True}
    first.stop()

    note, v2_event = health_event(subscription, impact_event_type=never_sent["type"], created=time.time())
    fake_stripe.add_v2_event(v2_event)
    post_concurrently(receiver, [note, note], thin=True)       # delivered twice: one alert all the same
    assert_recorded_without_any_api_call(kit, fake_stripe, [note])
    multiproc = tmp_path / "prometheus-thin-worker"
    multiproc.mkdir()
    port = free_port()
    worker = start_workers(configured_worker_factory, settings, fake_stripe, concurrency=2,
                           env={"METRICS_PORT": str(port), "PROMETHEUS_MULTIPROC_DIR": str(multiproc)})[0]
    wait_processed(kit, [note["id"]])

    assert attempt_outcomes(kit)[note["id"]] == ["processed"]
    assert kit.query("SELECT status, source_event_id FROM billing.subscriptions") == [
        {"status": "canceled", "source_event_id": "api_fetch"}]
    assert kit.query("SELECT event_id, failed_event_type, related_object_id, repair FROM ledger.health_alerts") == [
        {"event_id": note["id"], "failed_event_type": "customer.subscription.deleted",
         "related_object_id": subscription["id"], "repair": "applied"}]
    assert [r.path for r in fake_stripe.requests] == [f"/v2/core/events/{note['id']}",
                                                      f"/v1/subscriptions/{subscription['id']}"]
    lines = wait_until(lambda: [r for r in json_lines(worker.log()) if r.get("message", "").startswith(HEALTH_LINE)],
                       timeout_s=10, what="the health alert's log line")
    assert len(lines) == 1 and lines[0]["related_object_id"] == subscription["id"], lines
    assert lines[0]["repair"] == "applied"
    alerts = ("stripe_health_alerts_total",
              frozenset({"failed_type": "customer.subscription.deleted", "repair": "applied"}.items()))
    found = wait_until(lambda: (scrape(port) or {}).get(alerts), timeout_s=10, what="the worker's /metrics")
    assert found == 1
