"""End to end: Stripe events applied by real Celery workers, their effects delivered by the outbox to a
real local HTTP backend that fails, times out, rejects or is down; workers SIGKILLed; events redelivered
and re-applied. Every intended effect lands, and lands once."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest

from devkit.factories import SubscriptionHistory
from devkit.procs import free_port, wait_until
from tests.support.effect_endpoint import SECRET
from tests.support.outbox_handlers import (LIFECYCLE_ENTITLEMENT_CHANGES, customer_features, lifecycle_expected_keys,
                                           outbox_rows)
from tests.support.workers import run_ledgerctl
from workers.app import make_celery
from workers.runtime import Runtime
from tests.support.ledger_fixtures import BROKERS

# On Redis and on a RabbitMQ vhost of the test's own.
pytestmark = pytest.mark.parametrize("broker_settings", BROKERS, indirect=True)

LEASE_S = 5  # the minimum Settings accepts: a killed worker's leases expire quickly


def _settings(broker_settings, endpoint, **overrides):
    return dataclasses.replace(broker_settings, lease_s=LEASE_S, retry_base_s=0.1, retry_cap_s=0.5,
                               sweep_overdue_s=0.5, outbox_webhook_url=endpoint.url,
                               outbox_webhook_secret=SECRET, outbox_timeout_s=0.5, **overrides)


@contextlib.contextmanager
def _runtime(settings):
    """The sweep and a waker, in-process, as `ledgerctl sweep` builds them."""
    celery = make_celery(settings)
    runtime = Runtime(settings, celery)
    try:
        yield runtime
    finally:
        runtime.pool.close()
        celery.close()


def _settle(runtime, check, *, what: str, timeout_s: float = 120):
    """Run sweep passes until ``check()`` holds (the sweep re-drives whatever a kill or a lost wake-up stranded)."""
    def step():
        runtime.sweeper.run_once()
        return check()
    return wait_until(step, timeout_s=timeout_s, interval_s=0.25, what=what)


def _poll(check, *, timeout_s: float):
    """``check()``'s first truthy value within ``timeout_s``, else None (no failure)."""
    try:
        return wait_until(check, timeout_s=timeout_s, interval_s=0.01)
    except AssertionError:
        return None


def _all_processed(kit, ids) -> bool:
    rows = kit.query("SELECT status FROM ledger.events WHERE id = ANY(%s)", (list(ids),))
    return len(rows) == len(set(ids)) and all(r["status"] == "processed" for r in rows)


def _statuses(kit) -> dict[str, int]:
    return {r["status"]: r["n"] for r in kit.query("SELECT status, count(*) AS n FROM ledger.outbox GROUP BY 1")}


def _all_sent(kit) -> bool:
    return set(_statuses(kit)) == {"sent"}


def test_every_effect_lands_once_through_faults_kills_redeliveries_and_re_applies(
        kit, broker_settings, worker_factory, effect_endpoint):
    endpoint = effect_endpoint(fail_fraction=0.3, timeout_fraction=0.1, timeout_sleep_s=1.0, seed=1234,
                               max_faults_per_key=4)
    settings = _settings(broker_settings, endpoint, max_attempts=12)
    # Six customers; half end canceled (no features left), half stay active (their cancellation never comes).
    histories = [SubscriptionHistory().lifecycle() for _ in range(6)]
    plans = [(h, h.events if i % 2 == 0 else h.events[:9]) for i, h in enumerate(histories)]
    expected = set().union(*(lifecycle_expected_keys(h, upto=len(events)) for h, events in plans))
    assert len(expected) == 3 * 5 + 3 * 4
    all_ids = [e["id"] for _, events in plans for e in events]

    workers = [worker_factory(settings, concurrency=2, label="a"), worker_factory(settings, concurrency=1, label="b")]
    stranded: list[dict] = []
    with _runtime(settings) as runtime:
        waker = runtime.waker
        steps = max(len(events) for _, events in plans)
        for step in range(steps):
            # One event per customer at a time, in the customer's order (so the lifecycle alone says which
            # effects are due); customers run concurrently.
            batch = [events[step]["id"] for _, events in plans if step < len(events)]
            # Mid-run, at a step whose events announce entitlement changes, SIGKILL every worker while
            # deliveries are in flight (the backend holds its answers a little): leases of half-done
            # deliveries and applies, prefetched wake-ups, all abandoned. Should every delivery seen in
            # flight finish before the kill lands, again at the next such step.
            kill = step >= steps // 2 and step in LIFECYCLE_ENTITLEMENT_CHANGES and not stranded
            endpoint.stall_s = 0.4 if kill else 0.0
            for (history, events) in plans:
                if step < len(events):
                    kit.record(events[step])
                    waker.wake(events[step]["id"])
            if kill:
                _poll(lambda: kit.query("SELECT 1 FROM ledger.outbox WHERE status = 'sending'"), timeout_s=30)
                for worker in workers:
                    worker.kill()
                endpoint.stall_s = 0.0
                stranded = kit.query("SELECT id, idempotency_key, attempts FROM ledger.outbox "
                                     "WHERE status = 'sending'")
                workers = [worker_factory(settings, concurrency=2, label="c"),
                           worker_factory(settings, concurrency=1, label="d")]
            _settle(runtime, lambda: _all_processed(kit, batch), what=f"step {step} processed")

        # Stripe redelivers a third of the events (all already processed: acknowledged, nothing re-applied)...
        redelivered = all_ids[::3]
        for evt_id in redelivered:
            kit.record(next(e for _, events in plans for e in events if e["id"] == evt_id))
            waker.wake(evt_id)
        # ...and an operator re-applies every invoice.payment_failed (whose handler emits on every apply)
        # and every first subscription event: the business writes run again, effects must not.
        reapplied = [events[i]["id"] for _, events in plans for i in (1, 4)]
        recorded = [(r["id"], r["idempotency_key"]) for r in outbox_rows(kit)]
        result = run_ledgerctl(settings, "replay", "--force", "--why", "outbox test", *reapplied)
        assert result.returncode == 0, result.stderr
        _settle(runtime, lambda: _all_processed(kit, all_ids) and _all_sent(kit),
                what="every event processed and every effect sent")
        # A last sweep pass finds nothing left to re-drive.
        assert runtime.sweeper.run_once().effects_redriven == 0

    rows = outbox_rows(kit)
    keys = [r["idempotency_key"] for r in rows]
    # Each intended effect recorded exactly once: the same set from the ledger and from the lifecycle,
    # and re-applying events added no row.
    assert sorted(keys) == sorted(expected)
    assert [(r["id"], r["idempotency_key"]) for r in rows] == recorded
    assert {r["status"] for r in rows} == {"sent"}
    # Each arrived at least once and was applied exactly once; nothing unintended arrived.
    snapshot = endpoint.snapshot()
    assert set(snapshot["applied"]) == expected and set(snapshot["applied"].values()) == {1}
    assert set(snapshot["calls_total"]) == expected and min(snapshot["calls_total"].values()) >= 1
    assert endpoint.bad_signatures == 0 and endpoint.key_mismatches == 0 and endpoint.body_conflicts == []
    # One business fact, one key: no (effect, event, customer) reached the backend under two keys.
    facts = [(b["type"], b["event_id"], b["ordering_key"]) for b in endpoint.arrivals()]
    assert len(facts) == len(set(facts)) == len(expected)
    # The chaos really happened: failures (and, most runs, timeouts), a kill mid-delivery.
    assert snapshot["faults"].get("unavailable", 0) > 0
    assert sum(snapshot["calls_total"].values()) > len(expected)
    assert stranded, "the kill was meant to interrupt a delivery in flight"
    for row in stranded:
        assert outbox_rows(kit, "id = %s", (row["id"],))[0]["attempts"] > row["attempts"]
    # Events: redeliveries recorded, re-applies ran, everything processed.
    assert all(kit.deliveries(evt_id) == 2 for evt_id in redelivered)
    assert all(kit.event(evt_id)["attempts"] >= 2 for evt_id in reapplied)
    # Entitlements: keeping each customer's highest sequence yields exactly the ledger's entitlements.
    final = endpoint.final_entitlements()
    for history, events in plans:
        assert final[history.customer_id] == customer_features(kit, history.customer_id) == \
            ([] if len(events) == len(history.events) else ["reports", "seats"])


def test_a_rejected_effect_fails_permanently_and_an_operator_replay_delivers_it_once_fixed(
        kit, broker_settings, worker_factory, effect_endpoint):
    endpoint = effect_endpoint()
    endpoint.reject(422)
    settings = _settings(broker_settings, endpoint)
    history = SubscriptionHistory().lifecycle()
    worker_factory(settings, concurrency=1)
    with _runtime(settings) as runtime:
        for evt in history.events:
            kit.record(evt)
            runtime.waker.wake(evt["id"])
        ids = [e["id"] for e in history.events]
        _settle(runtime, lambda: _all_processed(kit, ids) and set(_statuses(kit)) == {"failed_permanent"}
                and sum(_statuses(kit).values()) >= 1, what="every effect rejected")

        rows = outbox_rows(kit)
        assert {(r["failure_reason"], r["attempts"], r["last_error"]) for r in rows} == \
            {("rejected_http_422", 1, "HTTP 422")}  # permanent: never retried on its own
        assert any(r["effect"] == "invoice.payment_failed" for r in rows)
        assert endpoint.applied_keys() == set()
        assert all(endpoint.calls_total[r["idempotency_key"]] == 1 for r in rows)

        endpoint.heal()
        result = run_ledgerctl(settings, "outbox", "replay", "--status", "failed_permanent", "--yes")
        assert result.returncode == 0, result.stderr
        assert f"{len(rows)} replayed, 0 skipped" in result.stdout
        _settle(runtime, lambda: _all_sent(kit), what="the replayed effects sent")

    after = outbox_rows(kit)
    assert [r["id"] for r in after] == [r["id"] for r in rows]  # the same rows, not new ones
    assert all(r["attempts"] == 2 and r["failure_reason"] is None for r in after)
    assert endpoint.applied_keys() == {r["idempotency_key"] for r in rows}
    assert set(endpoint.applied.values()) == {1}


def test_the_event_ledger_never_waits_for_a_backend_that_is_down(
        kit, broker_settings, worker_factory, effect_endpoint):
    # The backend's port is chosen now and stays closed: connections are refused until it binds it.
    endpoint = effect_endpoint(port=free_port(), start=False)
    settings = _settings(broker_settings, endpoint, max_attempts=1000)  # down for a while, not forever
    histories = [SubscriptionHistory().lifecycle() for _ in range(3)]
    ids = [e["id"] for h in histories for e in h.events]
    worker_factory(settings, concurrency=2)
    with _runtime(settings) as runtime:
        for h in histories:
            for evt in h.events:
                kit.record(evt)
                runtime.waker.wake(evt["id"])
        _settle(runtime, lambda: _all_processed(kit, ids), what="every event processed while the backend is down")
        # Processed, and not one effect delivered: the effects wait on their own, retrying.
        statuses = _statuses(kit)
        assert statuses and set(statuses) <= {"pending", "sending", "failed_recoverable"}
        wait_until(lambda: kit.query("SELECT 1 FROM ledger.outbox WHERE status = 'failed_recoverable' "
                                     "AND failure_reason = 'network' AND attempts >= 2"), timeout_s=60,
                   what="deliveries retried against the closed port")
        assert not endpoint.running and endpoint.calls_total == {}
        payment_failed = {f"{h.events[4]['id']}:invoice.payment_failed" for h in histories}
        assert payment_failed <= {r["idempotency_key"] for r in outbox_rows(kit)}

        endpoint.start()  # the backend is back, on the URL the workers were configured with
        _settle(runtime, lambda: _all_sent(kit), what="every effect delivered once the backend is back")

    keys = {r["idempotency_key"] for r in outbox_rows(kit)}
    assert endpoint.applied_keys() == keys and set(endpoint.applied.values()) == {1}
    assert payment_failed <= keys
    for h in histories:
        # (A customer whose events all raced past each other may have had nothing to announce.)
        assert endpoint.final_entitlements().get(h.customer_id, []) == customer_features(kit, h.customer_id) == []


