"""Prometheus endpoints of real processes: the receiver (2 workers, under each server docs/configuration.md supports),
a Celery worker (prefork, 2 children) and ``ledgerctl sweep --loop``, each with the series it promises
and values that match what the test made happen.

Every process runs in a process group of its own and is SIGKILLed with its group at teardown.
"""
from __future__ import annotations

import dataclasses
import os
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devkit.factories import body_of, event, sign
from devkit.procs import free_port, wait_until
from devkit.stack import SUPPORTED_RECEIVER_SERVERS, Sweep
from tests.support.constants import WEBHOOK_SECRET
from tests.support.outbox_handlers import outbox_with_every_state
from tests.support.receiver import WakeupQueue, receiver_env
from tests.support.workers import env_for
from workers.app import make_celery
from workers.wakeup import Waker


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert response.status == 200
            return response.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of an exposition: (sample name, labels) -> value."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


def scrape_until(port: int, expected: dict[tuple, float], what: str) -> dict:
    """Scrape until every expected (name, labels) sample has its value; the last scrape's samples."""
    last: dict = {}

    def matches():
        nonlocal last
        text = scrape(port)
        if text is None:
            return False
        last = samples(text)
        return all(last.get((name, frozenset(labels))) == v for (name, labels), v in expected.items())

    try:
        wait_until(matches, timeout_s=30, interval_s=0.1, what=what)
    except AssertionError:
        wrong = {k: (last.get((k[0], frozenset(k[1]))), v) for k, v in expected.items()
                 if last.get((k[0], frozenset(k[1]))) != v}
        raise AssertionError(f"{what}: (found, expected) {wrong}") from None
    return last


def key(name: str, **labels: str) -> tuple[str, tuple]:
    return name, tuple(sorted(labels.items()))


@pytest.fixture
def start_sweep(tmp_path):
    """Start ``ledgerctl sweep --loop`` (devkit.stack.Sweep) with this environment; SIGKILL its group at teardown."""
    started: list[Sweep] = []

    def start(env: dict[str, str]) -> Sweep:
        sweep = Sweep(env, tmp_path)
        started.append(sweep)
        return sweep.start()

    yield start
    for sweep in started:
        sweep.kill()


@pytest.mark.parametrize("server", SUPPORTED_RECEIVER_SERVERS)
def test_the_receiver_counts_requests_duplicates_and_latency_across_its_workers(
        broker_settings, start_receiver, tmp_path, server):
    multiproc = tmp_path / "prometheus-receiver"
    multiproc.mkdir()
    receiver = start_receiver(receiver_env(broker_settings.database_url, broker_settings.broker_url, WEBHOOK_SECRET,
                                           LEDGER_QUEUE=broker_settings.queue_name,
                                           PROMETHEUS_MULTIPROC_DIR=str(multiproc)), server=server, workers=2)
    bodies = [body_of(event("test.effect", {"id": f"obj_{n}"}, created=int(time.time()))) for n in range(3)]
    for body in [*bodies, bodies[0]]:  # the last one: Stripe delivers the first event again
        answer = receiver.post(body.encode(), {"Stripe-Signature": sign(body, WEBHOOK_SECRET)})
        assert answer.status_code == 200, answer.body
    forged = receiver.post(bodies[1].encode(), {"Stripe-Signature": sign(bodies[1], "whsec_someone_else_123")})
    assert forged.status_code == 400

    found = scrape_until(receiver.port, {
        key("ingest_requests_total", outcome="received"): 3,
        key("ingest_requests_total", outcome="duplicate"): 1,
        key("ingest_requests_total", outcome="invalid_signature"): 1,
        key("ingest_duplicates_total", status="received"): 1,
        key("ingest_request_seconds_count"): 5,
        key("ingest_request_seconds_bucket", le="+Inf"): 5,
    }, "the receiver's metrics")
    assert value(found, "ingest_request_seconds_sum") > 0
    buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in found.items()
                     if name == "ingest_request_seconds_bucket")
    assert len(buckets) > 5 and [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    assert value(found, "ingest_wakeups_failed_total") == 0


def test_a_worker_serves_attempt_retry_and_rescue_metrics_summed_over_its_children(
        kit, broker_settings, configured_worker_factory, tmp_path):
    settings = broker_settings
    multiproc = tmp_path / "prometheus-worker"
    multiproc.mkdir()
    port = free_port()
    configured_worker_factory(settings, concurrency=2, env={"METRICS_PORT": str(port),
                                                            "PROMETHEUS_MULTIPROC_DIR": str(multiproc)})
    at = int(time.time())
    ids = {
        "effect": [kit.record(event("test.effect", {"id": f"obj_{n}"}, created=at)) for n in range(2)],
        "flaky": [kit.record(event("test.flaky", {"id": "obj_flaky", "succeed_on_attempt": 2}, created=at))],
        # No id: the generic mirror cannot keep it, and no other handler takes the type.
        "unsupported": [kit.record(event("test.nohandler", {"object": "test_object"}, created=at))],
        "permanent": [kit.record(event("test.permanent", {"id": "obj_perm"}, created=at))],
        "rescued": [kit.record(event("test.effect", {"id": "obj_rescued"}, created=at))],
    }
    # A worker claimed this one and died: its lease has run out.
    [rescued] = ids["rescued"]
    assert kit.ledger("dead-worker").claim([rescued], worker="dead:1", lease_s=30)
    kit.execute("UPDATE ledger.events SET lease_expires_at = now() - interval '1 second' WHERE id = %s", (rescued,))

    celery = make_celery(settings, publisher_only=True)
    try:
        waker = Waker(celery)
        for evt_id in [i for group in ids.values() for i in group]:
            assert waker.wake(evt_id)
    finally:
        celery.close()
    for evt_id in ids["effect"] + ids["flaky"] + ids["rescued"]:
        kit.wait_status(evt_id, "processed")
    for evt_id in ids["unsupported"] + ids["permanent"]:
        kit.wait_status(evt_id, "failed_permanent")
    assert kit.attempts(rescued)[0]["outcome"] == "lease_expired"

    found = scrape_until(port, {
        key("worker_attempts_total", type="test.effect", outcome="processed", reason=""): 3,
        key("worker_attempts_total", type="test.flaky", outcome="failed_recoverable", reason="transient"): 1,
        key("worker_attempts_total", type="test.flaky", outcome="processed", reason=""): 1,
        key("worker_attempts_total", type="test.nohandler", outcome="failed_permanent",
            reason="object_without_id"): 1,
        key("worker_attempts_total", type="test.permanent", outcome="failed_permanent",
            reason="rejected_by_handler"): 1,
        key("worker_retries_scheduled_total", type="test.flaky", reason="transient"): 1,
        key("worker_attempt_seconds_count", type="test.effect"): 3,
        key("worker_attempt_seconds_count", type="test.flaky"): 2,
        key("worker_attempt_seconds_bucket", type="test.flaky", le="+Inf"): 2,
        key("worker_rescues_total", reason="lease_expired", work="event"): 1,
    }, "the worker's metrics")
    assert value(found, "worker_attempt_seconds_sum", type="test.effect") > 0
    assert sum(v for (name, _), v in found.items() if name == "worker_attempts_total") == 7
    assert any(f.startswith("counter_") for f in os.listdir(multiproc)), "children did not write to the dir"


def test_the_sweep_loop_serves_ledger_gauges_and_its_redrives(prepared_ledger, kit, broker_settings, start_sweep):
    # Every unfinished event's wake-up is an hour old: the ones that could run now are overdue.
    kit.execute("UPDATE ledger.events SET wakeup_at = now() - interval '1 hour' "
                "WHERE status IN ('received', 'processing', 'failed_recoverable')")
    groups = prepared_ledger.groups
    runnable = sorted(groups["received"] + groups["due_retry"] + groups["expired_lease"])
    settings = dataclasses.replace(broker_settings, sweep_overdue_s=600)  # one re-drive each, never a second
    port = free_port()
    start_sweep(env_for(settings, extra={"METRICS_PORT": str(port)}))

    expected = {key("ledger_events", status=s): n for s, n in prepared_ledger.by_status().items()}
    expected.update({key("sweep_redrives_total"): len(runnable), key("ledger_due_retries"): 1,
                     key("ledger_expired_leases"): 1})
    found = scrape_until(port, expected, "the sweep's metrics")
    assert len(runnable) == 4
    assert {dict(labels)["status"] for (name, labels) in found if name == "ledger_events"} == set(
        prepared_ledger.by_status())
    age = value(found, "ledger_oldest_unprocessed_age_seconds")
    assert 7200 <= age < 3 * 3600

    redriven = kit.query("SELECT id FROM ledger.events WHERE redrives > 0 ORDER BY id")
    assert [r["id"] for r in redriven] == runnable
    queue = WakeupQueue(settings.broker_url, settings.queue_name)
    assert sorted(m["args"][0] for m in queue.messages()) == runnable


def test_the_sweep_service_serves_the_outbox_gauges(kit, broker_settings, effect_endpoint, start_sweep):
    outbox_with_every_state(kit, effect_endpoint())
    port = free_port()
    sweep = start_sweep(env_for(broker_settings, extra={"METRICS_PORT": str(port), "LEDGER_SWEEP_INTERVAL_S": "0.5"}))

    def scraped():
        assert sweep.alive, sweep.log(2000)
        return scrape(port)
    text = wait_until(scraped, timeout_s=60, interval_s=0.2, what="the sweep's /metrics")
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["outbox_depth"] == 8
    assert values["outbox_failed_permanent"] == 1
    assert values["outbox_oldest_unsent_age_seconds"] > 0
