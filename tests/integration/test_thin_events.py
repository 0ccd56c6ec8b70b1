"""Thin event notifications in-process: the worker fetches what each points at from the fake Stripe API
(outside the apply transaction), applies it through the snapshot twin's handlers, and classifies failed
fetches (429/5xx/timeouts recoverable on our schedule with Retry-After, 404/refused key permanent); health
alerts repair the object and are recorded once; an unknown v2 type ends unsupported_type without a call.
The receiver's side: tests/integration/test_receiver_thin.py; real processes: tests/e2e/test_thin_e2e.py."""
from __future__ import annotations

import dataclasses
import json
import time
from datetime import datetime, timezone

import pytest

from devkit.factories import SubscriptionHistory, health_event, incoming, thin_twin, v2_event
from tests.support.stripe_api import API_KEY, TimedFake, api_settings, fake_stripe  # noqa: F401
from tests.support.workers import RecordingWaker, claim_one
from workers import metrics
from workers.processor import Outcome

NOW = int(time.time())
# What a subscription row is as business state: the ordering key's columns differ by design (a thin
# notification has its own id and a millisecond created).
SUBSCRIPTION_COLUMNS = ("id, customer_id, status, price_id, product_id, quantity, cancel_at_period_end, "
                        "current_period_start, current_period_end, trial_end, canceled_at, ended_at, features, "
                        "account, livemode")


def thin_of(evt: dict, *, account: str | None = None, fake=None) -> dict:
    """The thin notification of snapshot event ``evt``; with ``fake``, its v2 event is there too, naming
    ``evt`` as its snapshot twin (as Stripe's does). Without, the v2 event is not found: no twin."""
    note = thin_twin({**evt, "account": account} if account else evt)
    if fake is not None:
        fake.add_v2_event({**v2_event(note), "snapshot_event": evt["id"]}, account=account)
    return note


def transition_keys(kit) -> list[dict]:
    """Which events recorded a transition of which subscription (a thin one records the status fetched,
    not the one of its moment: docs/destinations.md, "How a thin event is processed")."""
    return kit.query("SELECT event_id, subscription_id FROM billing.subscription_transitions ORDER BY event_id")


def health_pair(obj: dict, *, failed_type: str) -> tuple[dict, dict]:
    return health_event(obj, impact_event_type=failed_type, created=time.time())


def processor(kit, settings, fake, **kw):
    return kit.processor(api_settings(settings, fake), modules=(), **kw)


def subscription_rows(kit) -> list[dict]:
    return kit.query(f"SELECT {SUBSCRIPTION_COLUMNS} FROM billing.subscriptions ORDER BY id")


def entitlement_rows(kit) -> list[dict]:
    return kit.query("SELECT customer_id, feature, source FROM billing.entitlements ORDER BY 1, 2")


def history_with_current_state(fake, api_version: str | None = None) -> SubscriptionHistory:
    """A lifecycle whose last subscription and customer states are what the fake API answers now."""
    history = SubscriptionHistory(start=NOW - 3600, **({"api_version": api_version} if api_version else {}))
    history.lifecycle()
    for evt in history.events:
        fake.put_object(evt["data"]["object"])
    return history


@pytest.mark.parametrize("api_version", [None, "2025-03-31.basil", "2025-09-30.clover"])
def test_thin_notifications_of_a_lifecycle_give_the_rows_its_snapshot_events_give(
        kit, settings, fake_stripe, api_version):
    history = history_with_current_state(fake_stripe, api_version)
    snapshot_processor = processor(kit, settings, fake_stripe)
    for evt in history.events:
        snapshot_processor.process(kit.record(evt))
    from_snapshots = (subscription_rows(kit), entitlement_rows(kit), transition_keys(kit))
    kit.wipe()

    thin_processor = processor(kit, settings, fake_stripe)
    notes = [thin_of(evt, fake=fake_stripe) for evt in history.events]
    for note in notes:
        assert thin_processor.process(kit.record(note)) is Outcome.PROCESSED
    # The same rows; the transitions too, keyed by the snapshot events' ids the v2 events name.
    assert (subscription_rows(kit), entitlement_rows(kit), transition_keys(kit)) == from_snapshots
    # Per notification: its v2 event (for the snapshot twin's id), then the object it named.
    fetched = [r.path for r in fake_stripe.requests]
    assert fetched == [path for note in notes
                       for path in (f"/v2/core/events/{note['id']}", note["related_object"]["url"])]


class CheckingFake(TimedFake):
    """Notes, while it answers, the state of every connection of the processor's pool ('thinproc')."""

    def _answer(self, path, params, account):
        self.seen.extend(self.kit.query(
            "SELECT state, xact_start FROM pg_stat_activity WHERE application_name = 'thinproc'"))
        return super()._answer(path, params, account)


@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
def test_no_transaction_is_open_while_a_notification_is_fetched(kit, settings, batch):
    with CheckingFake.serving(API_KEY) as fake:
        fake.kit, fake.seen = kit, []
        history = history_with_current_state(fake)
        ids = [kit.record(history.events[0]), *(kit.record(thin_of(evt)) for evt in history.events[1:4])]
        proc = processor(kit, settings, fake, name="thinproc")
        claim_one(proc.ledger, "evt_warm_the_pool", worker="w", lease_s=1)  # the pool holds an idle connection
        outcomes = proc.process_batch(ids) if batch else [proc.process(event_id) for event_id in ids]
    assert outcomes == [Outcome.PROCESSED] * 4
    assert len(fake.seen) >= 3 and all(s["state"] == "idle" and s["xact_start"] is None for s in fake.seen), \
        fake.seen


def test_the_same_notification_delivered_again_after_it_was_processed_fetches_nothing_more(
        kit, settings, fake_stripe):
    history = history_with_current_state(fake_stripe)
    note = thin_of(history.events[1])
    proc = processor(kit, settings, fake_stripe)
    assert proc.process(kit.record(note)) is Outcome.PROCESSED
    delivery = kit.store().record_delivery(incoming(note))
    assert (delivery.inserted, delivery.needs_wakeup) == (False, False)
    assert proc.process(note["id"]) is Outcome.NOT_CLAIMED
    assert len(fake_stripe.requests) == 2 and kit.deliveries(note["id"]) == 2  # its v2 event, its object


def test_notifications_applied_newest_first_end_with_the_state_applied_oldest_first(kit, settings, fake_stripe):
    history = history_with_current_state(fake_stripe)
    proc = processor(kit, settings, fake_stripe)
    for evt in reversed(history.events):
        assert proc.process(kit.record(thin_of(evt))) is Outcome.PROCESSED
    newest_first = subscription_rows(kit)
    kit.wipe()
    for evt in history.events:
        proc.process(kit.record(thin_of(evt)))
    assert subscription_rows(kit) == newest_first
    assert newest_first[0]["status"] == "canceled"


def test_a_rate_limited_fetch_fails_recoverably_waiting_at_least_stripes_retry_after_then_completes(
        kit, settings, fake_stripe):
    history = history_with_current_state(fake_stripe)
    note = thin_of(history.events[1])
    waker = RecordingWaker()
    proc = processor(kit, settings, fake_stripe, waker=waker)
    fake_stripe.fail_next(1, status=429, retry_after=7)
    event_id = kit.record(note)
    assert proc.process(event_id) is Outcome.FAILED_RECOVERABLE
    row = kit.event(event_id)
    assert row["failure_reason"] == "stripe_api_rate_limited"
    wait_s = (row["next_attempt_at"] - datetime.now(timezone.utc)).total_seconds()
    assert 5 < wait_s <= 7.5, wait_s  # Retry-After (7 s) over our backoff (the tests' base is a fraction of that)
    assert kit.query("SELECT count(*) AS n FROM billing.subscriptions")[0]["n"] == 0
    # Due again (as the sweep or the retry's wake-up would find it): the next attempt completes.
    kit.execute("UPDATE ledger.events SET next_attempt_at = now() WHERE id = %s", (event_id,))
    assert proc.process(event_id) is Outcome.PROCESSED
    assert [a["outcome"] for a in kit.attempts(event_id)] == ["failed_recoverable", "processed"]


@pytest.mark.parametrize("status, reason", [(500, "stripe_api_server_error"), (503, "stripe_api_server_error")])
def test_a_server_error_while_fetching_is_recoverable(kit, settings, fake_stripe, status, reason):
    history = history_with_current_state(fake_stripe)
    fake_stripe.fail_next(1, status=status)
    event_id = kit.record(thin_of(history.events[1]))
    assert processor(kit, settings, fake_stripe).process(event_id) is Outcome.FAILED_RECOVERABLE
    assert kit.event(event_id)["failure_reason"] == reason


def test_a_fetch_that_times_out_is_recoverable(kit, settings, fake_stripe):
    history = history_with_current_state(fake_stripe)
    fake_stripe.slow_next(1, seconds=2)
    event_id = kit.record(thin_of(history.events[1]))
    proc = processor(kit, dataclasses.replace(settings, stripe_fetch_timeout_s=0.3), fake_stripe)
    assert proc.process(event_id) is Outcome.FAILED_RECOVERABLE
    assert kit.event(event_id)["failure_reason"] == "stripe_api_timeout"


def test_an_object_stripe_does_not_have_ends_permanent_naming_the_path(kit, settings, fake_stripe):
    history = SubscriptionHistory(start=NOW - 3600).lifecycle()  # nothing put in the fake
    note = thin_of(history.events[1])
    event_id = kit.record(note)
    assert processor(kit, settings, fake_stripe).process(event_id) is Outcome.FAILED_PERMANENT
    row = kit.event(event_id)
    assert row["failure_reason"] == "stripe_object_not_found"
    assert note["related_object"]["url"] in row["last_error"] and "404" in row["last_error"]


def test_a_key_stripe_refuses_ends_permanent_and_never_appears_in_the_error(kit, settings, fake_stripe):
    history = history_with_current_state(fake_stripe)
    event_id = kit.record(thin_of(history.events[1]))
    wrong = dataclasses.replace(api_settings(settings, fake_stripe), stripe_api_key="sk_test_wrong_key_0123456789")
    proc = kit.processor(wrong, modules=())
    assert proc.process(event_id) is Outcome.FAILED_PERMANENT
    row = kit.event(event_id)
    assert row["failure_reason"] == "stripe_api_unauthorized"
    assert "sk_test_wrong_key_0123456789" not in row["last_error"]


def test_without_an_api_key_a_thin_notification_ends_permanent_with_what_to_set(kit, settings, fake_stripe):
    history = history_with_current_state(fake_stripe)
    event_id = kit.record(thin_of(history.events[1]))
    proc = kit.processor(dataclasses.replace(settings, stripe_api_key=None), modules=())
    assert proc.process(event_id) is Outcome.FAILED_PERMANENT
    row = kit.event(event_id)
    assert row["failure_reason"] == "stripe_api_key_missing" and "STRIPE_API_KEY" in row["last_error"]


def test_a_notification_of_the_other_mode_than_the_key_ends_permanent_without_a_call(kit, settings, fake_stripe):
    history = history_with_current_state(fake_stripe)
    note = {**thin_of(history.events[1]), "livemode": True}  # the fake's key is sk_test_
    event_id = kit.record(note)
    assert processor(kit, settings, fake_stripe).process(event_id) is Outcome.FAILED_PERMANENT
    assert kit.event(event_id)["failure_reason"] == "stripe_api_key_mode"
    assert fake_stripe.requests == []


def test_an_unknown_v2_type_ends_unsupported_type_without_any_api_call(kit, settings, fake_stripe):
    note = {"id": "evt_test_v2unknown", "object": "v2.core.event", "type": "v2.money_management.payout.created",
            "created": "2026-11-30T10:00:00.123Z", "livemode": False,
            "related_object": {"id": "po_1", "type": "v2.money_management.payout",
                               "url": "/v2/money_management/payouts/po_1"}}
    event_id = kit.record(note)
    assert processor(kit, settings, fake_stripe).process(event_id) is Outcome.FAILED_PERMANENT
    assert kit.event(event_id)["failure_reason"] == "unsupported_type"
    assert fake_stripe.requests == []


def test_a_connected_accounts_notification_is_fetched_with_its_context_and_writes_that_accounts_rows(
        kit, settings, fake_stripe):
    account = "acct_thin_connected"
    history = SubscriptionHistory(start=NOW - 3600).lifecycle()
    fake_stripe.put_object(history.events[1]["data"]["object"], account=account)
    note = thin_of(history.events[1], account=account, fake=fake_stripe)
    assert processor(kit, settings, fake_stripe).process(kit.record(note)) is Outcome.PROCESSED
    assert [(r.account, r.status) for r in fake_stripe.requests] == [(account, 200), (account, 200)]
    assert kit.query("SELECT account FROM billing.subscriptions")[0]["account"] == account


def test_a_batch_fetches_its_thin_members_first_and_a_failed_fetch_fails_only_its_own_event(
        kit, settings, fake_stripe):
    history = history_with_current_state(fake_stripe)
    customer, subscription = history.events[0], history.events[1]
    missing = SubscriptionHistory(start=NOW - 3600).lifecycle().events[1]  # its object is not at the fake
    ids = [kit.record(customer), kit.record(thin_of(subscription, fake=fake_stripe)), kit.record(thin_of(missing))]
    outcomes = processor(kit, settings, fake_stripe).process_batch(ids)
    assert outcomes == [Outcome.PROCESSED, Outcome.PROCESSED, Outcome.FAILED_PERMANENT]
    assert kit.status(ids[2]) == "failed_permanent"
    assert [r["status"] for r in subscription_rows(kit)] == ["canceled"]


def test_a_health_alert_refetches_the_object_whose_event_was_never_sent_and_is_recorded_once(
        kit, settings, fake_stripe, caplog):
    history = history_with_current_state(fake_stripe)
    subscription = history.events[-1]["data"]["object"]  # its customer.subscription.deleted was never sent
    note, v2_event = health_pair(subscription, failed_type="customer.subscription.deleted")
    fake_stripe.add_v2_event(v2_event)
    before = metrics.HEALTH_ALERTS.labels("customer.subscription.deleted", "applied")._value.get()
    proc = processor(kit, settings, fake_stripe)
    with caplog.at_level("WARNING", logger="workers.health"):
        assert proc.process(kit.record(note)) is Outcome.PROCESSED
    assert [r["status"] for r in subscription_rows(kit)] == ["canceled"]
    assert kit.query("SELECT source_event_id FROM billing.subscriptions")[0]["source_event_id"] == "api_fetch"
    alert = kit.query("SELECT failed_event_type, related_object_type, related_object_id, repair "
                      "FROM ledger.health_alerts")
    assert alert == [{"failed_event_type": "customer.subscription.deleted", "related_object_type": "subscription",
                      "related_object_id": subscription["id"], "repair": "applied"}]
    assert metrics.HEALTH_ALERTS.labels("customer.subscription.deleted", "applied")._value.get() == before + 1
    lines = [r for r in caplog.records if r.getMessage().startswith("stripe failed to generate an event")]
    assert len(lines) == 1 and lines[0].related_object_id == subscription["id"]
    assert [r.path for r in fake_stripe.requests] == [f"/v2/core/events/{note['id']}",
                                                      f"/v1/subscriptions/{subscription['id']}"]
    # Processed again (a replay): the object is fetched again, the alert stays one row, no second line.
    kit.execute("UPDATE ledger.events SET status = 'received', processed_at = NULL WHERE id = %s", (note["id"],))
    caplog.clear()
    assert proc.process(note["id"]) is Outcome.PROCESSED
    assert kit.query("SELECT count(*) AS n FROM ledger.health_alerts")[0]["n"] == 1
    assert not [r for r in caplog.records if r.getMessage().startswith("stripe failed to generate an event")]


def test_a_health_alert_about_an_object_stripe_no_longer_has_is_recorded_for_the_operator(
        kit, settings, fake_stripe):
    history = SubscriptionHistory(start=NOW - 3600).lifecycle()
    note, v2_event = health_pair(history.events[1]["data"]["object"], failed_type="customer.subscription.updated")
    fake_stripe.add_v2_event(v2_event)
    assert processor(kit, settings, fake_stripe).process(kit.record(note)) is Outcome.PROCESSED
    assert kit.query("SELECT repair FROM ledger.health_alerts") == [{"repair": "object_not_found"}]
    assert subscription_rows(kit) == []


def test_ledgerctl_health_lists_the_alerts_newest_first_with_their_repair(kit, settings, fake_stripe, ledgerctl_cli):
    history = history_with_current_state(fake_stripe)
    proc = processor(kit, settings, fake_stripe)
    gone = SubscriptionHistory(start=NOW - 3600).lifecycle().events[1]["data"]["object"]  # not at the fake
    for obj, failed_type in ((history.events[-1]["data"]["object"], "customer.subscription.deleted"),
                             (gone, "customer.subscription.updated")):
        note, v2_event = health_pair(obj, failed_type=failed_type)
        fake_stripe.add_v2_event(v2_event)
        assert proc.process(kit.record(note)) is Outcome.PROCESSED
    listed = json.loads(ledgerctl_cli("health", "--json").stdout)
    assert [(a["failed_event_type"], a["related_object_id"], a["repair"]) for a in listed] == [
        ("customer.subscription.updated", gone["id"], "object_not_found"),
        ("customer.subscription.deleted", history.subscription_id, "applied")]
    table = ledgerctl_cli("health").stdout.splitlines()
    assert table[0].split()[:3] == ["RECORDED_AT", "FAILED_EVENT_TYPE", "RELATED_OBJECT_TYPE"] and len(table) == 3



def test_a_thin_payment_failure_announces_the_effect_its_snapshot_twin_announces(kit, settings, fake_stripe):
    history = history_with_current_state(fake_stripe)
    failed = next(evt for evt in history.events if evt["type"] == "invoice.payment_failed")
    fake_stripe.put_object(failed["data"]["object"])  # the invoice as it was when its payment failed
    proc = dataclasses.replace(processor(kit, settings, fake_stripe),
                               enabled_effects=frozenset({"invoice.payment_failed"}))
    note = thin_of(failed)
    assert proc.process(kit.record(note)) is Outcome.PROCESSED
    assert kit.query("SELECT effect, event_id FROM ledger.outbox") == [
        {"effect": "invoice.payment_failed", "event_id": note["id"]}]


def test_a_thin_deletion_whose_object_stripe_no_longer_has_marks_the_rows_deleted(kit, settings, fake_stripe):
    history = history_with_current_state(fake_stripe)
    invoice = next(evt for evt in history.events if evt["type"] == "invoice.paid")
    proc = processor(kit, settings, fake_stripe)
    assert proc.process(kit.record(thin_of(invoice))) is Outcome.PROCESSED
    deleted = {**invoice, "id": "evt_snapshot_invoice_deleted", "type": "invoice.deleted",
               "created": invoice["created"] + 60}
    fake_stripe.delete_object(invoice["data"]["object"]["id"])  # Stripe answers 404 for a deleted invoice
    assert proc.process(kit.record(thin_of(deleted))) is Outcome.PROCESSED
    assert kit.query("SELECT id, deleted FROM billing.invoices") == [
        {"id": invoice["data"]["object"]["id"], "deleted": True}]
    assert kit.query("SELECT deleted FROM billing.objects WHERE object_type = 'invoice'") == [{"deleted": True}]


@pytest.mark.parametrize("snapshot_first", [True, False], ids=["snapshot_then_thin", "thin_then_snapshot"])
def test_a_change_delivered_both_as_snapshot_and_thin_announces_its_effect_once(
        kit, settings, fake_stripe, snapshot_first):
    history = history_with_current_state(fake_stripe)
    failed = next(evt for evt in history.events if evt["type"] == "invoice.payment_failed")
    fake_stripe.put_object(failed["data"]["object"])
    note = thin_of(failed, fake=fake_stripe)  # its v2 event names ``failed`` as its snapshot event
    proc = dataclasses.replace(processor(kit, settings, fake_stripe),
                               enabled_effects=frozenset({"invoice.payment_failed"}))
    for evt in ((failed, note) if snapshot_first else (note, failed)):
        assert proc.process(kit.record(evt)) is Outcome.PROCESSED
    # Two ledger events (each its own delivery and state), one change: one effect, keyed by the snapshot id.
    effects = kit.query("SELECT effect, idempotency_key, event_id FROM ledger.outbox")
    assert [(e["effect"], e["idempotency_key"]) for e in effects] == [
        ("invoice.payment_failed", f"{failed['id']}:invoice.payment_failed")]
    assert effects[0]["event_id"] == (failed["id"] if snapshot_first else note["id"])
    assert kit.query("SELECT snapshot_event_id, event_id FROM ledger.snapshot_twins") == [
        {"snapshot_event_id": failed["id"], "event_id": note["id"]}]


def test_catch_up_does_not_record_again_a_change_a_thin_notification_brought(
        kit, settings, fake_stripe, ledgerctl_cli):
    from tests.support.stripe_api import env_of

    history = history_with_current_state(fake_stripe)
    recent = [{**evt, "created": NOW - 600 + n} for n, evt in enumerate(history.events[:3])]
    fake_stripe.add_events(recent)  # what /v1/events lists: the snapshot events
    proc = processor(kit, settings, fake_stripe)
    for evt in recent[:2]:
        assert proc.process(kit.record(thin_of(evt, fake=fake_stripe))) is Outcome.PROCESSED

    dry = json.loads(ledgerctl_cli("catchup", "--dry-run", "--json", env=env_of(fake_stripe)).stdout)
    assert (dry["listed"], dry["missed"], dry["duplicates"]) == (3, 1, 2)
    run = json.loads(ledgerctl_cli("catchup", "--json", env=env_of(fake_stripe)).stdout)
    assert (run["listed"], run["skipped"], run["recorded"], run["missed"]) == (3, 2, 1, 1)
    assert kit.query("SELECT id FROM ledger.events WHERE id = ANY(%s)", ([e["id"] for e in recent],)) == [
        {"id": recent[2]["id"]}]


def test_ledgerctl_shows_the_rows_a_thin_notification_wrote_under_its_snapshot_twins_id(
        kit, settings, fake_stripe, ledgerctl_cli):
    history = history_with_current_state(fake_stripe)
    note = thin_of(history.events[1], fake=fake_stripe)
    assert processor(kit, settings, fake_stripe).process(kit.record(note)) is Outcome.PROCESSED
    shown = json.loads(ledgerctl_cli("events", "show", note["id"], "--json").stdout)
    assert {(r["table_name"], r["row_id"].split()[0]) for r in shown["domain_rows"]} == {
        ("billing.subscriptions", history.subscription_id),
        ("billing.subscription_transitions", history.subscription_id)}


class OverlapFake(TimedFake):
    """Answers each request after a pause, as Stripe's 100-400 ms, noting how many were answered at once."""

    def reset(self) -> None:
        super().reset()
        self.in_flight = self.most_in_flight = 0

    def _answer(self, path, params, account):
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(0.2)
            return super()._answer(path, params, account)
        finally:
            with self._lock:
                self.in_flight -= 1


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_batch_fetches_its_thin_notifications_up_to_the_configured_number_at_once(kit, settings, concurrency):
    with OverlapFake.serving(API_KEY) as fake:
        history = history_with_current_state(fake)
        ids = [kit.record(thin_of(evt, fake=fake)) for evt in history.events[:6]]
        proc = processor(kit, dataclasses.replace(settings, stripe_fetch_concurrency=concurrency), fake)
        assert proc.process_batch(ids) == [Outcome.PROCESSED] * 6
        assert fake.most_in_flight == concurrency
        assert len(fake.requests) == 12
