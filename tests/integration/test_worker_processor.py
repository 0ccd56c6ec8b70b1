"""EventProcessor in-process: outcomes, failure classification, retry scheduling, retries driven by the sweep."""
from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest

from ledger.attempts import WorkerLedger
from devkit.factories import OLD_API, SubscriptionHistory, event, incoming
from devkit.procs import run_together, wait_until
from tests.support.workers import RecordingWaker, claim_one
from workers.app import make_celery
from workers.processor import EventProcessor, Outcome
from workers.registry import HandlerRegistry
from workers.retry import RetryPolicy
from workers.sweep import Sweeper

RACE_ROUNDS = 30  # ids two processors race for, one at a time


class UpperBoundRng:
    """Makes the full-jitter delay deterministic: always the ceiling."""

    def uniform(self, low: float, high: float) -> float:
        return high


def make_event(event_type: str, **obj) -> dict:
    return event(event_type, {"id": "obj_test", **obj}, created=int(time.time()))



def deterministic(processor: EventProcessor, *, base_s: float, cap_s: float | None = None) -> EventProcessor:
    processor.policy = RetryPolicy(base_s=base_s, cap_s=cap_s or base_s, max_attempts=processor.policy.max_attempts,
                                   rng=UpperBoundRng())
    return processor


def wait_until_due(kit, event_id: str) -> None:
    wait_until(lambda: kit.event(event_id)["next_attempt_at"] <= kit.event(event_id)["db_now"],
               timeout_s=30, what=f"{event_id} to be due")


# --- success ---------------------------------------------------------------------------------

def test_an_event_is_processed_once_and_a_second_wakeup_is_not_claimed(kit):
    evt_id = kit.record(make_event("test.effect"))
    processor = kit.processor()
    assert processor.process(evt_id) is Outcome.PROCESSED
    assert processor.process(evt_id) is Outcome.NOT_CLAIMED
    row = kit.event(evt_id)
    assert row["status"] == "processed" and row["attempts"] == 1 and row["processed_at"] is not None
    assert row["lease_owner"] is None and row["lease_expires_at"] is None and row["failure_reason"] is None
    [attempt] = kit.attempts(evt_id)
    assert attempt["outcome"] == "processed" and attempt["finished_at"] is not None
    assert kit.effects(evt_id) == 1


def test_an_unknown_event_id_is_not_claimed(kit):
    assert kit.processor().process("evt_never_recorded") is Outcome.NOT_CLAIMED


def test_every_matching_handler_runs_in_order_in_one_transaction_all_or_nothing(kit):
    calls: list[str] = []

    def first(ctx):
        calls.append("first")
        ctx.conn.execute("INSERT INTO public.test_effects (event_id) VALUES (%s)", (ctx.event_id,))

    def second(ctx):
        calls.append("second")
        ctx.conn.execute("INSERT INTO public.test_effects (event_id) VALUES (%s)", (ctx.event_id,))
        if ctx.attempt == 1:
            raise RuntimeError("second handler fails on the first attempt")

    registry = HandlerRegistry()
    registry.register("test.multi", first)
    registry.register("test.*", second)
    processor = EventProcessor(ledger=kit.ledger(), registry=registry, waker=None, lease_s=30,
                               policy=RetryPolicy(base_s=0.01, cap_s=0.01, max_attempts=5))
    evt_id = kit.record(make_event("test.multi"))

    assert processor.process(evt_id) is Outcome.FAILED_RECOVERABLE
    assert calls == ["first", "second"]
    assert kit.effects(evt_id) == 0  # the first handler's write rolled back with the second's failure
    assert kit.event(evt_id)["failure_reason"] == "unexpected_error"

    wait_until_due(kit, evt_id)
    assert processor.process(evt_id) is Outcome.PROCESSED
    assert calls == ["first", "second", "first", "second"]
    assert kit.effects(evt_id) == 2  # one row per handler, committed together


# --- recoverable failures and our own retries ------------------------------------------------

def test_a_recoverable_failure_with_a_short_delay_schedules_its_own_countdown_wakeup(kit):
    waker = RecordingWaker()
    processor = deterministic(kit.processor(waker=waker), base_s=4.0)
    evt_id = kit.record(make_event("test.flaky", succeed_on_attempt=2))

    assert processor.process(evt_id) is Outcome.FAILED_RECOVERABLE
    row = kit.event(evt_id)
    assert row["status"] == "failed_recoverable" and row["failure_reason"] == "transient"
    assert row["next_attempt_at"] > row["db_now"]
    assert (row["next_attempt_at"] - row["updated_at"]).total_seconds() == pytest.approx(4.0, abs=0.01)
    # The wake-up rides a countdown equal to the delay, and the sweep is told not to send another.
    assert waker.woken == [(evt_id, 4.0)]
    assert row["wakeup_at"] == row["next_attempt_at"]
    assert row["lease_owner"] is None and row["lease_expires_at"] is None
    [attempt] = kit.attempts(evt_id)
    assert (attempt["outcome"], attempt["error_class"]) == ("failed_recoverable", "TransientError")
    assert kit.effects(evt_id) == 0
    # Not due yet: a wake-up arriving early claims nothing.
    assert processor.process(evt_id) is Outcome.NOT_CLAIMED


def test_a_retry_longer_than_the_broker_countdown_limit_is_left_to_the_sweep(kit):
    waker = RecordingWaker()
    processor = deterministic(kit.processor(waker=waker), base_s=1000.0)
    evt_id = kit.record(make_event("test.flaky"))
    received_wakeup = kit.event(evt_id)["wakeup_at"]

    assert processor.process(evt_id) is Outcome.FAILED_RECOVERABLE
    row = kit.event(evt_id)
    assert waker.woken == []
    assert row["wakeup_at"] == received_wakeup
    assert (row["next_attempt_at"] - row["updated_at"]).total_seconds() == pytest.approx(1000.0, abs=0.01)


def test_a_handler_failing_twice_then_succeeding_is_completed_by_the_sweep_alone(kit, broker_settings):
    settings = dataclasses.replace(broker_settings, sweep_overdue_s=0.1, retry_base_s=0.2, retry_cap_s=0.5)
    processor = kit.processor(settings, waker=None)
    ledger = WorkerLedger(kit.pool("sweeper"))
    waker = RecordingWaker()
    sweeper = Sweeper(ledger, waker, make_celery(settings), settings)
    evt_id = kit.record(make_event("test.flaky", succeed_on_attempt=3))
    time.sleep(0.15)  # the receiver's wake-up is lost: only the sweep will ever wake this event

    seen = 0
    deadline = time.monotonic() + 30
    while kit.status(evt_id) != "processed":
        assert time.monotonic() < deadline, f"not processed in time: {kit.event(evt_id)}"
        result = sweeper.run_once()
        assert not result.skipped_backlog
        for woken in waker.ids[seen:]:
            processor.process(woken)
        seen = len(waker.ids)
        time.sleep(0.05)

    row = kit.event(evt_id)
    assert row["attempts"] == 3
    assert [a["outcome"] for a in kit.attempts(evt_id)] == ["failed_recoverable", "failed_recoverable", "processed"]
    assert kit.effects(evt_id) == 1
    assert kit.deliveries(evt_id) == 1  # Stripe never re-sent it
    # One re-drive per retry: the sweep never sends a wake-up before the retry is due.
    assert waker.ids == [evt_id] * 3


def test_retries_exhausted_end_failed_permanent_with_reason_retries_exhausted(kit, settings):
    settings = dataclasses.replace(settings, max_attempts=3, retry_base_s=0.01, retry_cap_s=0.05)
    processor = kit.processor(settings)
    evt_id = kit.record(make_event("test.flaky", succeed_on_attempt=100))

    outcomes = [processor.process(evt_id)]
    while outcomes[-1] is Outcome.FAILED_RECOVERABLE:
        wait_until_due(kit, evt_id)
        outcomes.append(processor.process(evt_id))

    assert outcomes == [Outcome.FAILED_RECOVERABLE, Outcome.FAILED_RECOVERABLE, Outcome.FAILED_PERMANENT]
    row = kit.event(evt_id)
    assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed_permanent", "retries_exhausted", 3)
    assert "flaky handler fails attempt 3" in row["last_error"]
    assert row["next_attempt_at"] is None
    assert [a["outcome"] for a in kit.attempts(evt_id)] == ["failed_recoverable", "failed_recoverable",
                                                              "failed_permanent"]
    assert kit.effects(evt_id) == 0
    assert kit.ledger().take_overdue_wakeups(overdue_s=0, batch=100) == []
    assert processor.process(evt_id) is Outcome.NOT_CLAIMED


def test_an_event_whose_workers_keep_dying_ends_retries_exhausted_after_max_attempts(kit, settings):
    settings = dataclasses.replace(settings, max_attempts=1)
    evt_id = kit.record(make_event("test.effect"))
    dead = claim_one(kit.ledger(), evt_id, worker="dead-host:1", lease_s=1)  # the worker dies holding the lease
    assert dead is not None
    wait_until(lambda: kit.event(evt_id)["lease_expires_at"] < kit.event(evt_id)["db_now"], what="lease expiry")

    assert kit.processor(settings).process(evt_id) is Outcome.FAILED_PERMANENT
    row = kit.event(evt_id)
    assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed_permanent", "retries_exhausted", 2)
    attempts = kit.attempts(evt_id)
    assert [a["outcome"] for a in attempts] == ["lease_expired", "failed_permanent"]
    assert attempts[1]["error_class"] == "LeaseExpired"
    assert kit.effects(evt_id) == 0


# --- permanent failures ----------------------------------------------------------------------

def redeliver(kit, evt_id: str):
    """Stripe sends the stored event again."""
    stored = kit.query("SELECT payload::text AS p FROM ledger.events WHERE id = %s", (evt_id,))[0]["p"]
    return kit.store().record_delivery(incoming(json.loads(stored)))


def _assert_never_retried(kit, processor, evt_id):
    assert kit.ledger().take_overdue_wakeups(overdue_s=0, batch=100) == []
    assert processor.process(evt_id) is Outcome.NOT_CLAIMED
    assert redeliver(kit, evt_id).needs_wakeup is False  # a redelivery of a finished event wakes nobody
    assert kit.event(evt_id)["attempts"] == 1


def test_a_permanent_error_from_a_handler_fails_at_once_and_is_never_retried(kit):
    processor = kit.processor()
    evt_id = kit.record(make_event("test.permanent"))
    assert processor.process(evt_id) is Outcome.FAILED_PERMANENT
    row = kit.event(evt_id)
    assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed_permanent", "rejected_by_handler", 1)
    assert row["last_error"] == "test handler refuses this event"
    assert kit.effects(evt_id) == 0
    _assert_never_retried(kit, processor, evt_id)


def test_a_subscription_update_without_status_is_unmappable_and_names_the_field(kit):
    history = SubscriptionHistory(api_version=OLD_API).lifecycle()
    evt = history.events[2]
    del evt["data"]["object"]["status"]
    processor = kit.processor()
    evt_id = kit.record(evt)

    assert processor.process(evt_id) is Outcome.FAILED_PERMANENT
    row = kit.event(evt_id)
    assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed_permanent", "unmappable_payload", 1)
    assert "data.object.status" in row["last_error"]
    [attempt] = kit.attempts(evt_id)
    assert (attempt["outcome"], attempt["error_class"]) == ("failed_permanent", "UnmappablePayload")
    assert set(kit.billing_counts().values()) == {0}
    _assert_never_retried(kit, processor, evt_id)


def test_a_type_without_a_typed_handler_is_mirrored_and_processed(kit):
    processor = kit.processor()
    evt = event("charge.succeeded", {"id": "ch_1", "object": "charge", "amount": 100}, created=int(time.time()))
    assert processor.process(kit.record(evt)) is Outcome.PROCESSED
    assert {t: n for t, n in kit.billing_counts().items() if n} == {"objects": 1}
    [row] = kit.query("SELECT id, object_type, data, source_event_id FROM billing.objects")
    assert row == {"id": "ch_1", "object_type": "charge", "data": evt["data"]["object"], "source_event_id": evt["id"]}


def test_an_object_without_id_that_no_handler_takes_fails_permanently_without_any_business_write(kit):
    processor = kit.processor()
    # Stripe's upcoming invoice has no id: the mirror cannot key it, and no typed handler takes the type.
    evt_id = kit.record(event("invoice.upcoming", {"object": "invoice", "amount_due": 100}, created=int(time.time())))
    assert processor.process(evt_id) is Outcome.FAILED_PERMANENT
    row = kit.event(evt_id)
    assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed_permanent", "object_without_id", 1)
    assert row["last_error"].startswith("data.object has no id")
    [attempt] = kit.attempts(evt_id)
    assert (attempt["outcome"], attempt["error_class"]) == ("failed_permanent", "ObjectWithoutId")
    assert set(kit.billing_counts().values()) == {0}
    assert kit.effects() == 0
    _assert_never_retried(kit, processor, evt_id)


def test_a_type_no_registered_handler_takes_is_unsupported_before_any_write(kit, settings):
    """Only a registry without the built-in module (whose mirror takes every type) has such a type."""
    processor = EventProcessor.from_settings(settings, kit.ledger(), HandlerRegistry(), None)
    evt_id = kit.record(event("charge.succeeded", {"id": "ch_1", "object": "charge"}, created=int(time.time())))
    assert processor.process(evt_id) is Outcome.FAILED_PERMANENT
    row = kit.event(evt_id)
    assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed_permanent", "unsupported_type", 1)
    assert "charge.succeeded" in row["last_error"]
    assert set(kit.billing_counts().values()) == {0}


def test_a_constraint_violation_in_a_handler_is_permanent(kit):
    processor = kit.processor()
    evt_id = kit.record(make_event("test.bad_row"))
    assert processor.process(evt_id) is Outcome.FAILED_PERMANENT
    row = kit.event(evt_id)
    assert (row["failure_reason"], row["attempts"]) == ("constraint_violation", 1)
    assert "23502" in row["last_error"]
    assert kit.effects() == 0


# --- real Postgres errors are recoverable ----------------------------------------------------

def test_a_lock_timeout_inside_a_handler_is_a_recoverable_failure_due_in_the_future(kit):
    processor = deterministic(kit.processor(), base_s=60.0)
    evt_id = kit.record(make_event("test.lock_timeout", lock_id=1))
    kit.execute("INSERT INTO public.test_locks (id) VALUES (1)")

    with kit.connect() as holder:
        with holder.transaction():
            holder.execute("SELECT * FROM public.test_locks WHERE id = 1 FOR UPDATE")
            outcome = processor.process(evt_id)

    assert outcome is Outcome.FAILED_RECOVERABLE
    row = kit.event(evt_id)
    assert (row["status"], row["failure_reason"]) == ("failed_recoverable", "db_lock_timeout")
    assert "SQLSTATE 55P03" in row["last_error"]
    assert row["next_attempt_at"] > row["db_now"]
    assert kit.attempts(evt_id)[0]["error_class"] == "LockNotAvailable"
    assert kit.effects(evt_id) == 0

    # The lock is gone; a Stripe redelivery makes the retry due now, and it completes.
    assert redeliver(kit, evt_id).needs_wakeup is True
    assert processor.process(evt_id) is Outcome.PROCESSED
    assert kit.effects(evt_id) == 1
    assert kit.query("SELECT n FROM public.test_locks WHERE id = 1")[0]["n"] == 1


def test_a_statement_timeout_inside_a_handler_is_a_recoverable_db_timeout(kit):
    processor = deterministic(kit.processor(), base_s=60.0)
    evt_id = kit.record(make_event("test.statement_timeout"))
    assert processor.process(evt_id) is Outcome.FAILED_RECOVERABLE
    row = kit.event(evt_id)
    assert (row["status"], row["failure_reason"]) == ("failed_recoverable", "db_timeout")
    assert "SQLSTATE 57014" in row["last_error"]
    assert row["next_attempt_at"] > row["db_now"]
    assert kit.attempts(evt_id)[0]["error_class"] == "QueryCanceled"
    assert kit.effects(evt_id) == 0


# --- two processors racing for one id ---------------------------------------------------------

def test_two_threads_processing_the_same_id_at_once_apply_it_exactly_once(kit):
    ids = kit.record_many([event("test.effect", {"id": f"obj_{n}"}, created=int(time.time()))
                           for n in range(RACE_ROUNDS)])
    processors = [kit.processor(name=f"racer-{n}") for n in range(2)]  # a pool (own connections) each
    barrier = threading.Barrier(2)
    outcomes: dict[str, list[Outcome]] = {evt_id: [] for evt_id in ids}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def race(processor):
        try:
            for evt_id in ids:
                barrier.wait(timeout=30)
                outcome = processor.process(evt_id)
                with lock:
                    outcomes[evt_id].append(outcome)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    run_together(lambda i: race(processors[i]), len(processors))
    assert not errors, errors

    for evt_id in ids:
        assert sorted(outcomes[evt_id]) == sorted([Outcome.PROCESSED, Outcome.NOT_CLAIMED]), (evt_id, outcomes[evt_id])
        assert kit.effects(evt_id) == 1, evt_id
        row = kit.event(evt_id)
        assert row["status"] == "processed" and row["attempts"] == 1
    assert kit.effects() == RACE_ROUNDS
