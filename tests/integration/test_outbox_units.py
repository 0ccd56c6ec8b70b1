"""The outbox's parts, no network: the dispatcher's state machine against the real database (with
plain-function senders), and recording effects inside the apply transaction (if_configured, rollback,
re-apply under the UNIQUE idempotency key). Status classification and signing: tests/unit/test_effects.py."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest

from ledger.errors import LeaseLost
from ledger.operator import OperatorLedger
from ledger.outbox import OutboxLedger, record
from devkit.factories import SubscriptionHistory, event
from devkit.procs import wait_until
from tests.support.outbox_handlers import (LIFECYCLE_ENTITLEMENT_CHANGES, EffectWaker, lifecycle_expected_keys,
                                           outbox_processor, outbox_rows)
from workers.app import MAX_COUNTDOWN_S
from workers.dispatcher import OutboxDispatcher
from workers.effects import BUILT_IN_EFFECTS, DeliveryFailed, EffectDelivery
from workers.retry import RetryPolicy

LEASE_S = 30


# -- the dispatcher against the real database ------------------------------------------------------

def _record_effect(kit, effect: str = "entitlements.changed", *, key: str | None = "cus_1",
                   ordering_key: str | None = "cus_1", payload: dict | None = None) -> int:
    """One recorded effect (and the event it belongs to)."""
    evt_id = kit.record(event("test.emit", {"id": "obj"}, created=int(time.time())))
    with kit.connect() as conn:
        outbox_id = record(conn, idempotency_key=":".join(p for p in (evt_id, effect, key) if p), effect=effect,
                           event_id=evt_id, ordering_key=ordering_key,
                           payload=payload or {"customer_id": "cus_1", "entitlements": ["seats"]})
    assert outbox_id is not None
    return outbox_id


def _row(kit, outbox_id: int) -> dict:
    [row] = outbox_rows(kit, "id = %s", (outbox_id,))
    return row


def _make_due(kit, outbox_id: int) -> None:
    kit.execute("UPDATE ledger.outbox SET next_attempt_at = now() WHERE id = %s", (outbox_id,))


def _dispatcher(kit, senders, *, max_attempts: int = 3, waker=None) -> OutboxDispatcher:
    return OutboxDispatcher(ledger=OutboxLedger(kit.pool()), senders=senders,
                            policy=RetryPolicy(base_s=0.05, cap_s=0.1, max_attempts=max_attempts),
                            waker=waker, lease_s=LEASE_S)


class Recorder:
    """A sender: a plain callable that remembers its deliveries and raises what it is told to."""

    def __init__(self, *raises: BaseException | None):
        self.deliveries: list[EffectDelivery] = []
        self._raises = list(raises)

    def __call__(self, delivery: EffectDelivery) -> None:
        self.deliveries.append(delivery)
        exc = self._raises.pop(0) if self._raises else None
        if exc is not None:
            raise exc


def test_a_delivered_effect_is_sent_once_with_its_key_and_sequence(kit):
    outbox_id = _record_effect(kit)
    sender, waker = Recorder(), EffectWaker()
    dispatcher = _dispatcher(kit, {"entitlements.changed": sender}, waker=waker)

    assert dispatcher.dispatch(outbox_id) == "sent"
    row = _row(kit, outbox_id)
    [delivery] = sender.deliveries
    assert delivery == EffectDelivery(sequence=outbox_id, idempotency_key=row["idempotency_key"],
                                      effect="entitlements.changed", event_id=row["event_id"],
                                      ordering_key="cus_1", payload={"customer_id": "cus_1",
                                                                     "entitlements": ["seats"]})
    assert row["status"] == "sent" and row["sent_at"] is not None and row["attempts"] == 1
    assert row["lease_owner"] is None and row["failure_reason"] is None
    # Sent is final: a late or duplicate wake-up claims nothing and calls nobody.
    assert dispatcher.dispatch(outbox_id) == "not_claimed"
    assert len(sender.deliveries) == 1 and waker.effects == []


def test_an_effect_nobody_can_send_fails_permanently_with_no_sender(kit):
    outbox_id = _record_effect(kit, "crm.note", key=None)
    other = Recorder()
    assert _dispatcher(kit, {"entitlements.changed": other}).dispatch(outbox_id) == "failed_permanent"
    row = _row(kit, outbox_id)
    assert row["status"] == "failed_permanent" and row["failure_reason"] == "no_sender"
    assert "crm.note" in row["last_error"] and row["next_attempt_at"] is None
    assert other.deliveries == []


def test_a_recoverable_failure_is_scheduled_then_delivered_when_due(kit):
    outbox_id = _record_effect(kit)
    sender, waker = Recorder(DeliveryFailed("HTTP 503", permanent=False, reason="http_503")), EffectWaker()
    dispatcher = _dispatcher(kit, {"entitlements.changed": sender}, waker=waker)

    assert dispatcher.dispatch(outbox_id) == "failed_recoverable"
    row = _row(kit, outbox_id)
    assert row["status"] == "failed_recoverable" and row["failure_reason"] == "http_503"
    assert row["last_error"] == "HTTP 503" and row["lease_owner"] is None
    [(woken_id, countdown)] = waker.effects
    assert woken_id == outbox_id and 0 <= countdown <= 0.1
    assert row["updated_at"] <= row["next_attempt_at"] <= row["updated_at"] + timedelta(seconds=0.1)
    assert row["wakeup_at"] == row["next_attempt_at"]  # the countdown carries it; the sweep waits for that

    _wait_due(kit, outbox_id)
    assert dispatcher.dispatch(outbox_id) == "sent"
    row = _row(kit, outbox_id)
    assert row["status"] == "sent" and row["attempts"] == 2
    assert (row["failure_reason"], row["last_error"], row["next_attempt_at"]) == (None, None, None)
    assert [d.idempotency_key for d in sender.deliveries] == [row["idempotency_key"]] * 2


def _wait_due(kit, outbox_id):
    wait_until(lambda: (lambda r: r["next_attempt_at"] <= r["db_now"])(_row(kit, outbox_id)), timeout_s=10,
               what="the retry to be due")


def test_a_recoverable_failure_is_not_claimed_before_it_is_due(kit):
    outbox_id = _record_effect(kit)
    sender = Recorder(DeliveryFailed("HTTP 429", permanent=False, reason="rate_limited", retry_after_s=120))
    waker = EffectWaker()
    dispatcher = _dispatcher(kit, {"entitlements.changed": sender}, waker=waker)
    assert dispatcher.dispatch(outbox_id) == "failed_recoverable"
    row = _row(kit, outbox_id)
    # Retry-After (120 s) wins over the policy's backoff (at most 0.1 s).
    assert row["next_attempt_at"] - row["updated_at"] >= timedelta(seconds=119)
    assert waker.effects == [(outbox_id, 120.0)]
    assert dispatcher.dispatch(outbox_id) == "not_claimed"
    assert len(sender.deliveries) == 1


def test_a_retry_longer_than_a_safe_countdown_is_left_to_the_sweep(kit):
    outbox_id = _record_effect(kit)
    created = _row(kit, outbox_id)
    sender = Recorder(DeliveryFailed("HTTP 429", permanent=False, reason="rate_limited",
                                     retry_after_s=MAX_COUNTDOWN_S + 100))
    waker = EffectWaker()
    assert _dispatcher(kit, {"entitlements.changed": sender}, waker=waker).dispatch(outbox_id) == \
        "failed_recoverable"
    row = _row(kit, outbox_id)
    assert waker.effects == []  # no broker countdown past MAX_COUNTDOWN_S
    assert row["wakeup_at"] == created["wakeup_at"]  # so the sweep re-drives it once it is due
    assert row["next_attempt_at"] - row["updated_at"] >= timedelta(seconds=MAX_COUNTDOWN_S + 99)
    # Not due: the sweep leaves it alone however overdue its wake-up looks.
    assert OutboxLedger(kit.pool()).take_overdue_wakeups(overdue_s=0.1, batch=10) == []
    _make_due(kit, outbox_id)
    kit.execute("UPDATE ledger.outbox SET wakeup_at = now() - interval '1 minute' WHERE id = %s", (outbox_id,))
    assert OutboxLedger(kit.pool()).take_overdue_wakeups(overdue_s=0.1, batch=10) == [outbox_id]


def test_a_permanent_rejection_is_not_retried(kit):
    outbox_id = _record_effect(kit)
    sender = Recorder(DeliveryFailed("HTTP 422", permanent=True, reason="rejected_http_422"))
    waker = EffectWaker()
    dispatcher = _dispatcher(kit, {"entitlements.changed": sender}, waker=waker)
    assert dispatcher.dispatch(outbox_id) == "failed_permanent"
    row = _row(kit, outbox_id)
    assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed_permanent", "rejected_http_422", 1)
    assert row["next_attempt_at"] is None and waker.effects == []
    _make_due(kit, outbox_id)
    assert dispatcher.dispatch(outbox_id) == "not_claimed"


def test_a_senders_own_exception_is_recoverable(kit):
    outbox_id = _record_effect(kit)
    sender = Recorder(RuntimeError("backend SDK exploded"))
    assert _dispatcher(kit, {"entitlements.changed": sender}).dispatch(outbox_id) == "failed_recoverable"
    row = _row(kit, outbox_id)
    assert row["failure_reason"] == "unexpected_error" and "backend SDK exploded" in row["last_error"]


def test_exhausting_max_attempts_fails_permanently_and_a_replay_renews_the_budget(kit):
    outbox_id = _record_effect(kit)
    always = [DeliveryFailed("HTTP 503", permanent=False, reason="http_503") for _ in range(10)]
    sender = Recorder(*always)
    dispatcher = _dispatcher(kit, {"entitlements.changed": sender}, max_attempts=3)

    outcomes = []
    for _ in range(3):
        outcomes.append(dispatcher.dispatch(outbox_id))
        _make_due(kit, outbox_id)
    assert outcomes == ["failed_recoverable", "failed_recoverable", "failed_permanent"]
    row = _row(kit, outbox_id)
    assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed_permanent", "retries_exhausted", 3)
    assert dispatcher.dispatch(outbox_id) == "not_claimed"

    ledger = OutboxLedger(kit.pool())
    assert ledger.replay(outbox_id, force=False)
    row = _row(kit, outbox_id)
    assert (row["status"], row["failure_reason"], row["attempts"], row["attempt_base"]) == ("pending", None, 3, 3)
    # A fresh budget: the next failure is the first of three again, not the fourth.
    assert dispatcher.dispatch(outbox_id) == "failed_recoverable"
    assert _row(kit, outbox_id)["attempts"] == 4
    assert len(sender.deliveries) == 4


def _expire_lease(kit, outbox_id: int) -> None:
    kit.execute("UPDATE ledger.outbox SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
                (outbox_id,))


def test_a_live_lease_cannot_be_claimed_and_an_expired_one_can_only_be_finished_by_its_new_owner(kit):
    outbox_id = _record_effect(kit)
    ledger = OutboxLedger(kit.pool())
    first = ledger.claim(outbox_id, lease_s=LEASE_S)
    assert first is not None and first.tries == 1
    assert ledger.claim(outbox_id, lease_s=LEASE_S) is None  # live lease: nobody else

    _expire_lease(kit, outbox_id)
    second = ledger.claim(outbox_id, lease_s=LEASE_S)
    assert second is not None and second.lease_owner != first.lease_owner and second.attempt == 2

    with pytest.raises(LeaseLost):
        ledger.finish(first)
    with pytest.raises(LeaseLost):
        ledger.fail(first, status="failed_recoverable", reason="http_503", error="HTTP 503", delay_s=0.1,
                    wake_scheduled=False)
    row = _row(kit, outbox_id)
    assert (row["status"], row["lease_owner"]) == ("sending", second.lease_owner)
    ledger.finish(second)
    assert _row(kit, outbox_id)["status"] == "sent"


@pytest.mark.parametrize("then", ["sender succeeds", "sender fails"])
def test_a_dispatcher_whose_lease_was_taken_over_mid_call_does_not_finish(kit, then):
    outbox_id = _record_effect(kit)
    ledger = OutboxLedger(kit.pool())
    taken_over = []

    def slow_sender(delivery: EffectDelivery) -> None:
        # While this call is "in flight", the lease runs out and another dispatcher re-claims.
        _expire_lease(kit, outbox_id)
        taken_over.append(ledger.claim(outbox_id, lease_s=LEASE_S))
        if then == "sender fails":
            raise DeliveryFailed("HTTP 503", permanent=False, reason="http_503")

    waker = EffectWaker()
    dispatcher = _dispatcher(kit, {"entitlements.changed": slow_sender}, waker=waker)
    assert dispatcher.dispatch(outbox_id) == "lease_lost"
    [other] = taken_over
    row = _row(kit, outbox_id)
    assert (row["status"], row["lease_owner"], row["attempts"]) == ("sending", other.lease_owner, 2)
    assert waker.effects == []
    ledger.finish(other)
    assert _row(kit, outbox_id)["status"] == "sent"


class DispatcherGone(BaseException):
    """What a sender "raises" when its dispatcher dies mid-call (a SIGKILL, Celery's hard time limit):
    nothing in the dispatcher runs after it; the row keeps its lease until it expires."""


def test_an_effect_whose_dispatcher_keeps_dying_ends_retries_exhausted_instead_of_looping(kit):
    outbox_id = _record_effect(kit)
    calls = []

    def poison(delivery: EffectDelivery) -> None:
        calls.append(delivery)
        raise DispatcherGone()

    dispatcher = _dispatcher(kit, {"entitlements.changed": poison}, max_attempts=3)
    for attempt in range(1, 4):
        with pytest.raises(DispatcherGone):
            dispatcher.dispatch(outbox_id)
        assert (_row(kit, outbox_id)["status"], _row(kit, outbox_id)["attempts"]) == ("sending", attempt)
        _expire_lease(kit, outbox_id)  # the sweep's re-drive finds the lease expired
    # The rescue after the last allowed attempt gives up without calling the sender again,
    # as the event processor does for events whose workers keep dying.
    assert dispatcher.dispatch(outbox_id) == "failed_permanent"
    row = _row(kit, outbox_id)
    assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed_permanent", "retries_exhausted", 4)
    assert len(calls) == 3


# -- recording effects inside the apply transaction --------------------------------------------------

def _emit_event(effects: list[dict], **extra) -> dict:
    return event("test.emit", {"id": "obj", "effects": effects, **extra}, created=int(time.time()))


def test_an_if_configured_effect_without_a_sender_records_nothing(kit):
    spec = {"effect": "crm.note", "payload": {"n": 1}, "if_configured": True}
    waker = EffectWaker()
    unconfigured = kit.record(_emit_event([spec]))
    assert outbox_processor(kit, effects=(), waker=waker).process(unconfigured) == "processed"
    assert outbox_rows(kit) == [] and waker.effects == []

    configured = kit.record(_emit_event([spec]))
    assert outbox_processor(kit, effects=("crm.note",), waker=waker).process(configured) == "processed"
    [row] = outbox_rows(kit)
    assert row["idempotency_key"] == f"{configured}:crm.note" and row["status"] == "pending"
    assert waker.effect_ids == [row["id"]]  # woken after COMMIT


def test_an_unconditional_effect_is_recorded_even_without_a_sender(kit):
    evt_id = kit.record(_emit_event([{"effect": "crm.note", "key": "k1", "ordering_key": "cus_x"}]))
    assert outbox_processor(kit, effects=()).process(evt_id) == "processed"
    [row] = outbox_rows(kit)
    assert (row["idempotency_key"], row["ordering_key"]) == (f"{evt_id}:crm.note:k1", "cus_x")


def test_built_in_effects_are_silent_when_no_webhook_is_configured(kit):
    history = SubscriptionHistory().lifecycle()
    processor = outbox_processor(kit, effects=())
    for evt_id in kit.record_many(history.events):
        assert processor.process(evt_id) == "processed"
    assert outbox_rows(kit) == []
    assert kit.status(history.events[-1]["id"]) == "processed"


def test_a_failed_apply_records_no_effect_and_its_retry_records_it_once(kit):
    waker = EffectWaker()
    evt_id = kit.record(_emit_event([{"effect": "crm.note", "key": "k"}], fail_after_emit=True))
    processor = outbox_processor(kit, effects=("crm.note",), waker=waker)
    assert processor.process(evt_id) == "failed_recoverable"
    assert outbox_rows(kit) == [] and waker.effects == []  # rolled back with the attempt

    kit.execute("UPDATE ledger.events SET next_attempt_at = now() WHERE id = %s", (evt_id,))
    assert processor.process(evt_id) == "processed"
    [row] = outbox_rows(kit)
    assert row["idempotency_key"] == f"{evt_id}:crm.note:k"
    assert waker.effect_ids == [row["id"]]


def test_one_event_records_each_key_once(kit):
    evt_id = kit.record(_emit_event([{"effect": "crm.note", "key": "a"}, {"effect": "crm.note", "key": "b"},
                                     {"effect": "crm.note", "key": "a", "payload": {"dup": True}}]))
    waker = EffectWaker()
    assert outbox_processor(kit, effects=("crm.note",), waker=waker).process(evt_id) == "processed"
    rows = outbox_rows(kit)
    assert [r["idempotency_key"] for r in rows] == [f"{evt_id}:crm.note:a", f"{evt_id}:crm.note:b"]
    assert rows[0]["payload"] == {}  # the first emit won; the duplicate was not recorded
    assert waker.effect_ids == [r["id"] for r in rows]


def _reapply(kit, processor, evt_id: str) -> None:
    assert OperatorLedger(kit.pool()).replay(evt_id, actor="test", reason="re-apply", force=True) == "processed"
    assert processor.process(evt_id) == "processed"


def test_re_applying_events_records_no_second_effect(kit):
    waker = EffectWaker()
    processor = outbox_processor(kit, waker=waker)
    history = SubscriptionHistory().lifecycle()
    events = history.events[:9]  # ends active: the customer keeps its features
    for evt_id in kit.record_many(events):
        assert processor.process(evt_id) == "processed"
    before = outbox_rows(kit)
    assert {r["idempotency_key"] for r in before} == lifecycle_expected_keys(history, upto=9)
    woken = list(waker.effects)

    # Every event again (a replay --force of the whole history)...
    for evt in events:
        _reapply(kit, processor, evt["id"])
    # ...and the entitlement-changing one after the customer's entitlements drifted, so that its
    # re-application really changes them and emits entitlements.changed under the same key again.
    last_change = events[max(i for i in LIFECYCLE_ENTITLEMENT_CHANGES if i < 9)]
    kit.execute("DELETE FROM billing.entitlements WHERE customer_id = %s", (history.customer_id,))
    _reapply(kit, processor, last_change["id"])

    after = outbox_rows(kit)
    assert [(r["id"], r["idempotency_key"], r["payload"]) for r in after] == \
        [(r["id"], r["idempotency_key"], r["payload"]) for r in before]
    assert waker.effects == woken  # nothing new was recorded, so nothing new was woken
    assert sorted(r["feature"] for r in kit.query("SELECT feature FROM billing.entitlements WHERE customer_id = %s",
                                                  (history.customer_id,))) == ["reports", "seats"]


def test_effects_of_one_customer_carry_increasing_sequences_in_recording_order(kit):
    processor = outbox_processor(kit)
    histories = [SubscriptionHistory().lifecycle() for _ in range(2)]
    # Interleave the two customers' events: sequences are global, order holds per customer.
    for pair in zip(*(h.events for h in histories)):
        for evt in pair:
            kit.record(evt)
            assert processor.process(evt["id"]) == "processed"
    for history in histories:
        rows = outbox_rows(kit, "ordering_key = %s", (history.customer_id,))
        index = {evt["id"]: i for i, evt in enumerate(history.events)}
        assert [index[r["event_id"]] for r in rows] == sorted(index[r["event_id"]] for r in rows)
        assert [r["id"] for r in rows] == sorted(r["id"] for r in rows)
        assert {r["effect"] for r in rows} == set(BUILT_IN_EFFECTS)
        changes = [r["payload"]["entitlements"] for r in rows if r["effect"] == "entitlements.changed"]
        assert changes == [["reports", "seats"], [], ["reports", "seats"], []]
