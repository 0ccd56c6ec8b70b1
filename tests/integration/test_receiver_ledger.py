"""What an accepted delivery writes to the ledger and which wake-ups it sends.

The wake-ups are observed on the private Redis: with Celery's redis transport the
queue settings.queue_name is a Redis list.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from devkit.factories import sign
from devkit.procs import free_port, run_together
from tests.support.constants import WEBHOOK_SECRET, fixture_files
from tests.support.receiver import count_events, event_body, event_row, execute

FIXTURES = fixture_files()
COPIES = 20
# Each round is one more chance for copies to meet inside the INSERT.
ROUNDS = 5


def _deliver(client, body: str | bytes):
    text = body.decode() if isinstance(body, bytes) else body
    return client.post("/webhooks/stripe", data=body, headers={
        "Stripe-Signature": sign(text, WEBHOOK_SECRET), "Content-Type": "application/json"})


def test_a_new_event_is_recorded_as_received_and_one_wakeup_carrying_its_id_is_queued(
        receiver_client, db, wakeup_queue):
    body = event_body()
    event_id = json.loads(body)["id"]

    answer = _deliver(receiver_client, body)

    assert answer.status_code == 200
    assert answer.get_json() == {"outcome": "received", "event_id": event_id, "status": "received", "enqueued": True}
    row = event_row(db, event_id)
    assert (row["status"], row["deliveries"], row["payload"]) == ("received", 1, body)
    assert wakeup_queue.messages() == [{"task": "workers.process_event", "args": [event_id], "kwargs": {}}]


# status -> (UPDATE that puts a received row in that status within the table's CHECKs,
#            whether a redelivery must wake a worker)
STATUSES = {
    "received": (None, True),
    "processed": ("UPDATE ledger.events SET status = 'processed', processed_at = now(), attempts = 1 "
                  "WHERE id = %s", False),
    "failed_permanent": ("UPDATE ledger.events SET status = 'failed_permanent', attempts = 1, "
                         "failure_reason = 'unsupported_type', last_error = 'no handler' WHERE id = %s", False),
    "failed_recoverable": ("UPDATE ledger.events SET status = 'failed_recoverable', attempts = 1, "
                           "failure_reason = 'db_unavailable', last_error = 'connection lost', "
                           "next_attempt_at = now() + interval '1 hour', wakeup_at = now() + interval '1 hour' "
                           "WHERE id = %s", True),
    "processing with an expired lease": (
        "UPDATE ledger.events SET status = 'processing', attempts = 1, lease_owner = 'dead-worker', "
        "lease_expires_at = now() - interval '1 minute' WHERE id = %s", True),
    "processing with a live lease": (
        "UPDATE ledger.events SET status = 'processing', attempts = 1, lease_owner = 'live-worker', "
        "lease_expires_at = now() + interval '1 hour' WHERE id = %s", False),
}


@pytest.mark.parametrize("state", list(STATUSES), ids=list(STATUSES))
def test_a_redelivery_answers_duplicate_and_wakes_a_worker_only_when_the_event_still_needs_one(
        receiver_client, db, wakeup_queue, state):
    update, must_wake = STATUSES[state]
    status = state.split(" ")[0]
    body = event_body()
    event_id = json.loads(body)["id"]
    assert _deliver(receiver_client, body).get_json()["outcome"] == "received"
    if update:
        execute(db, update, (event_id,))
    before = event_row(db, event_id)
    wakeup_queue.clear()

    # Stripe redelivers the same bytes (a new signature timestamp, same body).
    answer = _deliver(receiver_client, body)

    assert answer.status_code == 200
    assert answer.get_json() == {"outcome": "duplicate", "event_id": event_id, "status": status,
                                 "enqueued": must_wake}
    expected_messages = [{"task": "workers.process_event", "args": [event_id], "kwargs": {}}] if must_wake else []
    assert wakeup_queue.messages() == expected_messages
    after = event_row(db, event_id)
    assert after["deliveries"] == 2
    assert (after["status"], after["payload"], after["lease_owner"]) == (
        before["status"], before["payload"], before["lease_owner"])
    if status == "failed_recoverable":
        # A redelivery is a second chance now, not after our own backoff.
        assert not before["due_now"] and after["due_now"]
    else:
        assert after["next_attempt_at"] == before["next_attempt_at"]


def test_a_redelivery_with_a_different_body_never_overwrites_the_recorded_payload(receiver_client, db, wakeup_queue):
    first = event_body()
    event_id = json.loads(first)["id"]
    second = event_body(event_id, type="customer.deleted")
    _deliver(receiver_client, first)

    answer = _deliver(receiver_client, second)

    assert answer.get_json()["outcome"] == "duplicate"
    row = event_row(db, event_id)
    assert (row["type"], row["payload"], row["deliveries"]) == ("customer.updated", first, 2)


def test_with_the_broker_down_an_event_is_still_acknowledged_and_durable(settings, make_receiver_app, db):
    down = dataclasses.replace(settings, broker_url=f"redis://127.0.0.1:{free_port()}/0")
    client = make_receiver_app(down).test_client()
    body = event_body()
    event_id = json.loads(body)["id"]

    first = _deliver(client, body)
    again = _deliver(client, body)

    assert first.status_code == 200
    assert first.get_json() == {"outcome": "received", "event_id": event_id, "status": "received", "enqueued": False}
    assert again.status_code == 200
    assert again.get_json() == {"outcome": "duplicate", "event_id": event_id, "status": "received", "enqueued": False}
    row = event_row(db, event_id)
    assert (row["status"], row["payload"], row["deliveries"]) == ("received", body, 2)


def test_concurrent_deliveries_of_one_event_make_one_row_and_count_every_delivery(
        settings, make_receiver_app, db, wakeup_queue):
    # A connection per copy, so every copy can be inside its INSERT at once.
    app = make_receiver_app(dataclasses.replace(settings, db_pool_max_size=COPIES))
    clients = [app.test_client() for _ in range(COPIES)]
    bodies = [event_body() for _ in range(ROUNDS)]

    for body in bodies:
        answers = run_together(lambda i: _deliver(clients[i], body), COPIES)

        assert sorted((a.status_code, a.get_json()["outcome"]) for a in answers) == (
            [(200, "duplicate")] * (COPIES - 1) + [(200, "received")])
        row = event_row(db, json.loads(body)["id"])
        assert (row["status"], row["deliveries"], row["payload"]) == ("received", COPIES, body)
    assert count_events(db) == ROUNDS


def test_the_payload_is_stored_byte_for_byte_however_it_is_written(receiver_client, db):
    event_id = "evt_test_formatting"
    body = ('{"id":"' + event_id + '",  "object" : "event","type":"customer.updated",\r\n'
            '"created":1718000000,"livemode":false,"api_version":null,'
            '"data":{"object":{"id":"cus_1","name":"Zo\u00eb \u00c5str\u00f6m \u2603 \U0001f600",'
            '"escaped":"caf\\u00e9 \\ud83d\\ude00 \\u0000","big":123456789012345678901234567890,'
            '"float":1.10,"exp":1E+2,"dup":1,"dup":2,"empty":{},"list":[ ]}}}\n\n')

    answer = _deliver(receiver_client, body.encode("utf-8"))

    assert answer.status_code == 200 and answer.get_json()["outcome"] == "received"
    row = event_row(db, event_id)
    assert row["payload"].encode("utf-8") == body.encode("utf-8")
    assert (row["api_version"], row["account"], row["livemode"]) == (None, None, False)


def test_envelope_fields_of_a_live_connect_event_are_stored(receiver_client, db):
    body = event_body(type="invoice.paid", livemode=True, account="acct_1ConnectedAccount",
                      api_version="2025-03-31.basil", created=1743465600)
    event_id = json.loads(body)["id"]

    assert _deliver(receiver_client, body).get_json()["outcome"] == "received"

    row = event_row(db, event_id)
    assert {k: row[k] for k in ("type", "livemode", "account", "api_version", "created")} == {
        "type": "invoice.paid", "livemode": True, "account": "acct_1ConnectedAccount",
        "api_version": "2025-03-31.basil", "created": 1743465600}


@pytest.mark.skipif(not FIXTURES, reason="no Stripe fixtures (shared/stripe-fixtures) on this machine")
@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_every_real_stripe_fixture_is_recorded_exactly_as_sent(receiver_client, db, path: Path):
    # Each file is its own scenario (placeholder ids repeat across files): `db` is clean per test.
    raw = path.read_bytes()
    event = json.loads(raw)

    answer = _deliver(receiver_client, raw)

    assert answer.status_code == 200, answer.get_data()[:300]
    assert answer.get_json()["outcome"] == "received"
    row = event_row(db, event["id"])
    assert row["payload"].encode("utf-8") == raw
    assert {k: row[k] for k in ("type", "created", "livemode", "api_version", "account", "status")} == {
        "type": event["type"], "created": event["created"], "livemode": event["livemode"] is True,
        "api_version": event.get("api_version"), "account": event.get("account"), "status": "received"}
