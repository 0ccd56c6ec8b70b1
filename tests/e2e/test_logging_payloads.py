"""Logs of the real receiver (gunicorn) and a real worker (celery): JSON lines that name the event
(event_id, type, attempt, outcome) and never carry its payload, on success and on every kind of failure.

Each event's object carries a marker string unique to the test run; it must reach the ledger's payload and
never any log line of either process. (What the ledger stores about a failure: tests/integration/test_stored_errors.py.)
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid

from devkit.factories import body_of, event, sign
from devkit.procs import wait_until
from tests.support.constants import WEBHOOK_SECRET
from tests.support.receiver import receiver_env
from tests.support.workers import json_lines


def test_receiver_and_worker_logs_name_each_attempt_and_never_contain_the_payload(
        kit, broker_settings, start_receiver, configured_worker_factory):
    marker = f"payload-marker-{uuid.uuid4().hex}"
    settings = dataclasses.replace(broker_settings, max_attempts=2)
    receiver = start_receiver(receiver_env(settings.database_url, settings.broker_url, WEBHOOK_SECRET,
                                           LEDGER_QUEUE=settings.queue_name, LOG_LEVEL="DEBUG"), workers=1)
    worker = configured_worker_factory(settings)

    at = int(time.time())
    events = {
        "processed": event("test.effect", {"id": "obj_ok", "description": marker}, created=at),
        "retried": event("test.flaky", {"id": "obj_flaky", "succeed_on_attempt": 2, "description": marker},
                         created=at),
        # No id: the generic mirror cannot keep it, and no other handler takes the type.
        "unsupported": event("test.nohandler", {"object": "test_object", "description": marker}, created=at),
        "rejected": event("test.permanent", {"id": "obj_perm", "description": marker}, created=at),
        "constraint": event("test.bad_row", {"id": "obj_bad", "description": marker}, created=at),
        # The handler's own exception message quotes the payload value (int('payload-marker-...')).
        "error_quotes_payload": event("test.flaky", {"id": "obj_quote", "succeed_on_attempt": marker}, created=at),
    }
    for evt in events.values():
        body = body_of(evt)
        answer = receiver.post(body.encode(), {"Stripe-Signature": sign(body, WEBHOOK_SECRET)})
        assert answer.status_code == 200, answer.body
    duplicate = body_of(events["processed"])
    assert receiver.post(duplicate.encode(), {"Stripe-Signature": sign(duplicate, WEBHOOK_SECRET)}).status_code == 200
    forged = body_of(event("test.effect", {"id": "obj_forged", "description": marker}, created=at))
    assert receiver.post(forged.encode(), {"Stripe-Signature": sign(forged, "whsec_forger_0123456")}).status_code == 400
    broken = f'{{"id": "evt_broken", "type": "test.effect", "data": {{"object": "{marker}"'
    assert receiver.post(broken.encode(), {"Stripe-Signature": sign(broken, WEBHOOK_SECRET)}).status_code == 400

    final = {"processed": ("processed", None), "retried": ("processed", None),
             "unsupported": ("failed_permanent", "object_without_id"),
             "rejected": ("failed_permanent", "rejected_by_handler"),
             "constraint": ("failed_permanent", "constraint_violation"),
             "error_quotes_payload": ("failed_permanent", "retries_exhausted")}
    for name, (status, reason) in final.items():
        row = kit.wait_status(events[name]["id"], status)
        assert row["failure_reason"] == reason, name
        assert marker in json.dumps(row["payload"]), "the marker must be in what was recorded"
    assert kit.effects() == 2  # processed + retried; every failed attempt rolled back

    # Every attempt in the history has its log line (written just after the attempt's outcome is committed).
    history = {(evt["id"], a["attempt"], evt["type"], a["outcome"]) for evt in events.values()
               for a in kit.attempts(evt["id"])}
    assert len(history) == 8  # one attempt each, two for each of the two test.flaky events
    wait_until(lambda: history <= {(line.get("event_id"), line.get("attempt"), line.get("type"), line.get("outcome"))
                                   for line in json_lines(worker.log())}, what="a log line for every attempt")
    worker_lines = json_lines(worker.log())
    for name, evt in events.items():
        for attempt in kit.attempts(evt["id"]):
            matching = [line for line in worker_lines
                        if line.get("event_id") == evt["id"] and line.get("attempt") == attempt["attempt"]]
            assert [(line["type"], line["outcome"]) for line in matching] == [(evt["type"], attempt["outcome"])], (
                name, attempt["attempt"], matching)
    failed = [line for line in worker_lines if line.get("message") == "attempt failed"]
    assert {line["reason"] for line in failed} >= {"transient", "object_without_id", "rejected_by_handler",
                                                   "constraint_violation", "unexpected_error", "retries_exhausted"}
    assert all(line["level"] == "WARNING" and line["error_class"] for line in failed)

    # The receiver logs before it answers: every line is there.
    receiver_log = receiver.log_path
    recorded = [line for line in json_lines(receiver_log.read_text()) if line.get("message") == "event recorded"]
    assert sorted((line["event_id"], line["type"], line["outcome"]) for line in recorded) == sorted(
        [(evt["id"], evt["type"], "received") for evt in events.values()]
        + [(events["processed"]["id"], "test.effect", "duplicate")])

    assert marker not in worker.log()
    assert marker not in receiver_log.read_text()
