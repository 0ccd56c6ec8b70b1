"""ledgerctl replay in-process: in bulk, as a dry run, with --force, with a fresh retry budget, never a live event.

The ledger is real Postgres throughout; events end processed through the in-process processor (the same
code a worker runs). A replay after a fix, picked up by a real worker process, is in
tests/e2e/test_ledgerctl_with_workers.py.
"""
from __future__ import annotations

import dataclasses
import json
import time

import pytest

from devkit.factories import SubscriptionHistory, event
from tests.support.operator import ACTOR, audit, ledger_rows
from tests.support.receiver import WakeupQueue
from tests.support.workers import RecordingWaker, claim_one, applying_one
from workers.processor import Outcome

BILLING_TABLES = ("customers", "subscriptions", "invoices", "checkout_sessions", "entitlements",
                  "entitlement_summaries", "subscription_transitions", "objects")


def now() -> int:
    return int(time.time())


def event_rows(kit, ids) -> dict[str, str]:
    return {r["id"]: r["j"] for r in kit.query(
        "SELECT id, row_to_json(e)::text AS j FROM ledger.events e WHERE id = ANY(%s)", (list(ids),))}


def billing_rows(kit) -> dict[str, list[dict]]:
    """Every billing row, every column but updated_at (when a row was last written, not what it says)."""
    rows = {}
    for table in BILLING_TABLES:
        found = kit.query(f"SELECT to_jsonb(t) - 'updated_at' AS r FROM billing.{table} t")
        rows[table] = sorted((r["r"] for r in found), key=lambda r: json.dumps(r, sort_keys=True))
    return rows


@pytest.fixture
def failures(kit, settings):
    """Events in every failed shape, plus a processed one, processed in-process (no broker)."""
    at = now()
    processor = kit.processor(waker=RecordingWaker())
    one_try = kit.processor(dataclasses.replace(settings, max_attempts=1), waker=RecordingWaker(), name="one-try")
    ids = {
        # No id (as Stripe's upcoming invoice): the mirror cannot keep them, and no other handler takes the type.
        "unsupported_invoice": kit.record(event("invoice.upcoming", {"object": "invoice"}, created=at)),
        "unsupported_test": kit.record(event("test.nohandler", {"object": "test_object"}, created=at)),
        "rejected": kit.record(event("test.permanent", {"id": "obj_rejected"}, created=at)),
        "exhausted": kit.record(event("test.flaky", {"id": "obj_exhausted", "succeed_on_attempt": 99}, created=at)),
        "recoverable": kit.record(event("test.flaky", {"id": "obj_recoverable", "succeed_on_attempt": 99},
                                        created=at)),
        "processed": kit.record(event("test.effect", {"id": "obj_processed"}, created=at)),
    }
    for name, evt_id in ids.items():
        (one_try if name == "exhausted" else processor).process(evt_id)
    reasons = {name: (r["status"], r["failure_reason"]) for name in ids for r in [kit.event(ids[name])]}
    assert reasons == {"unsupported_invoice": ("failed_permanent", "object_without_id"),
                       "unsupported_test": ("failed_permanent", "object_without_id"),
                       "rejected": ("failed_permanent", "rejected_by_handler"),
                       "exhausted": ("failed_permanent", "retries_exhausted"),
                       "recoverable": ("failed_recoverable", "transient"),
                       "processed": ("processed", None)}
    return ids


def test_a_dry_run_lists_the_selection_and_changes_nothing(ledgerctl_cli, kit, broker_settings, failures):
    queue = WakeupQueue(broker_settings.broker_url, broker_settings.queue_name)
    unsupported = sorted([failures["unsupported_invoice"], failures["unsupported_test"]])
    before = ledger_rows(kit)

    result = ledgerctl_cli("replay", "--status", "failed_permanent", "--reason", "object_without_id", "--dry-run")
    assert result.stdout.splitlines() == unsupported
    assert "2 event(s) would be replayed (dry run, nothing changed)" in result.stderr
    result = ledgerctl_cli("replay", "--status", "failed_permanent", "--reason", "object_without_id",
                           "--type", "test.*", "--dry-run", "--json")
    assert json.loads(result.stdout) == {"would_replay": [failures["unsupported_test"]]}
    result = ledgerctl_cli("replay", "--status", "failed_permanent", "--dry-run", "--json")
    assert sorted(json.loads(result.stdout)["would_replay"]) == sorted(
        [*unsupported, failures["rejected"], failures["exhausted"]])
    result = ledgerctl_cli("replay", "--status", "processed", "--force", "--dry-run", "--json")
    assert json.loads(result.stdout) == {"would_replay": [failures["processed"]]}
    result = ledgerctl_cli("replay", failures["rejected"], failures["processed"], "--dry-run", "--json")
    assert json.loads(result.stdout) == {"would_replay": [failures["rejected"], failures["processed"]]}

    assert ledger_rows(kit) == before
    assert len(queue) == 0, "a dry run sent wake-ups"


def test_bulk_replay_by_reason_replays_only_the_matching_events(ledgerctl_cli, kit, broker_settings, failures):
    queue = WakeupQueue(broker_settings.broker_url, broker_settings.queue_name)
    unsupported = sorted([failures["unsupported_invoice"], failures["unsupported_test"]])
    others = [i for i in failures.values() if i not in unsupported]
    untouched = event_rows(kit, others)

    result = ledgerctl_cli("replay", "--status", "failed_permanent", "--reason", "object_without_id", "--yes",
                           "--why", "handlers deployed", "--rate", "500", "--json")
    assert json.loads(result.stdout) == {
        "replayed": [{"id": i, "from_status": "failed_permanent"} for i in unsupported], "skipped": []}
    for evt_id in unsupported:
        row = kit.event(evt_id)
        assert (row["status"], row["failure_reason"], row["last_error"], row["attempt_base"]) == (
            "received", None, None, 1)
    assert event_rows(kit, others) == untouched
    assert audit(kit) == [{"event_id": i, "action": "replay", "actor": ACTOR, "reason": "handlers deployed",
                           "from_status": "failed_permanent"} for i in unsupported]
    assert sorted(m["args"][0] for m in queue.messages()) == unsupported

    # The same selection again finds nothing (they are waiting now): exit 1, nothing more audited.
    ledgerctl_cli("replay", "--status", "failed_permanent", "--reason", "object_without_id", "--yes", code=1)
    assert len(audit(kit)) == 2 and len(queue) == 2

    # A type glob narrows a status: no invoice is failed any more; of the test.* ones, only the exhausted one.
    ledgerctl_cli("replay", "--status", "failed_permanent", "--type", "invoice.*", "--yes", code=1)
    result = ledgerctl_cli("replay", "--status", "failed_permanent", "--type", "test.*", "--reason",
                           "retries_exhausted", "--yes", "--json")
    assert json.loads(result.stdout)["replayed"] == [{"id": failures["exhausted"], "from_status": "failed_permanent"}]
    assert kit.status(failures["rejected"]) == "failed_permanent"


def test_a_replayed_event_gets_a_fresh_retry_budget(ledgerctl_cli, kit, settings):
    two_tries = dataclasses.replace(settings, max_attempts=2)
    waker = RecordingWaker()
    processor = kit.processor(two_tries, waker=waker)
    evt_id = kit.record(event("test.flaky", {"id": "obj_budget", "succeed_on_attempt": 4}, created=now()))

    def due_now():
        kit.execute("UPDATE ledger.events SET next_attempt_at = now() WHERE id = %s AND status = "
                    "'failed_recoverable'", (evt_id,))

    assert processor.process(evt_id) is Outcome.FAILED_RECOVERABLE
    due_now()
    assert processor.process(evt_id) is Outcome.FAILED_PERMANENT
    assert (kit.event(evt_id)["failure_reason"], kit.event(evt_id)["attempts"]) == ("retries_exhausted", 2)

    ledgerctl_cli("replay", evt_id, "--why", "db fixed")
    assert (kit.status(evt_id), kit.event(evt_id)["attempt_base"]) == ("received", 2)
    # Attempt 3 is the first of a new budget of 2: it fails and is retried, not given up.
    assert processor.process(evt_id) is Outcome.FAILED_RECOVERABLE
    row = kit.event(evt_id)
    assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed_recoverable", "transient", 3)
    due_now()
    assert processor.process(evt_id) is Outcome.PROCESSED
    assert kit.effects(evt_id) == 1
    assert [(a["attempt"], a["outcome"]) for a in kit.attempts(evt_id)] == [
        (1, "failed_recoverable"), (2, "failed_permanent"), (3, "failed_recoverable"), (4, "processed")]


def test_replaying_processed_events_needs_force_and_changes_no_business_row(ledgerctl_cli, kit):
    history = SubscriptionHistory().lifecycle()
    processor = kit.processor(waker=RecordingWaker())
    ids = kit.record_many(history.events)
    for evt_id in ids:
        assert processor.process(evt_id) is Outcome.PROCESSED
    before = billing_rows(kit)
    transitions = kit.query("SELECT from_status, to_status FROM billing.subscription_transitions "
                            "ORDER BY event_created")
    assert [(t["from_status"], t["to_status"]) for t in transitions] == [
        (None, "trialing"), ("trialing", "active"), ("active", "past_due"), ("past_due", "active"),
        ("active", "active"), ("active", "canceled")]

    result = ledgerctl_cli("replay", ids[3], code=1)  # no --force: skipped
    assert f"skipped  {ids[3]}" in result.stdout and kit.status(ids[3]) == "processed"
    ledgerctl_cli("replay", "--status", "processed", "--yes", code=2)

    result = ledgerctl_cli("replay", "--status", "processed", "--force", "--yes", "--why", "re-apply", "--json")
    assert sorted(r["id"] for r in json.loads(result.stdout)["replayed"]) == sorted(ids)
    assert all(kit.status(i) == "received" for i in ids)
    for evt_id in reversed(ids):  # re-applied in the worst order: newest first
        assert processor.process(evt_id) is Outcome.PROCESSED

    assert billing_rows(kit) == before
    assert kit.query("SELECT count(*) AS n FROM billing.subscription_transitions")[0]["n"] == 6
    assert all([a["outcome"] for a in kit.attempts(i)] == ["processed", "processed"] for i in ids)
    assert {(a["from_status"], a["reason"]) for a in audit(kit)} == {("processed", "re-apply")}
    assert len(audit(kit)) == len(ids)


def test_an_event_a_worker_holds_or_one_already_waiting_is_never_replayed(ledgerctl_cli, kit, failures):
    held = kit.record(event("test.effect", {"id": "obj_held"}, created=now()))
    waiting = kit.record(event("test.effect", {"id": "obj_waiting"}, created=now()))
    claim = claim_one(kit.ledger("live-worker"), held, worker="live:1", lease_s=30)
    assert claim is not None and kit.status(held) == "processing"
    before = ledger_rows(kit)

    for args in ((held,), (held, "--force"), (waiting,), (waiting, "--force"), (held, waiting, "--force")):
        result = ledgerctl_cli("replay", *args, "--json", code=1)
        assert json.loads(result.stdout)["replayed"] == [], args
    assert ledger_rows(kit) == before

    # The live worker still owns its attempt and finishes it: one effect, no replay in its history.
    processor = kit.processor(waker=RecordingWaker())
    with applying_one(processor.ledger, claim) as conn:
        conn.execute("INSERT INTO public.test_effects (event_id) VALUES (%s)", (held,))
    assert kit.status(held) == "processed" and kit.effects(held) == 1
    assert audit(kit, held) == []
