"""The real receiver, `gunicorn 'ingest.app:create_app()'`, as a subprocess."""
from __future__ import annotations

import json

import pytest

from tests.conftest import WEBHOOK_SECRET
from tests.support.receiver import count_events, deliver_at_once, event_body, event_row, receiver_env, sign

pytestmark = pytest.mark.e2e

COPIES = 20
# Each round is one more chance for copies to meet inside the INSERT.
ROUNDS = 5


def _headers(body: str) -> dict:
    return {"Stripe-Signature": sign(body, WEBHOOK_SECRET)}


def test_every_acknowledged_event_survives_a_kill_9_of_the_receiver_right_after_the_last_200(
        db, redis_url, start_receiver):
    receiver = start_receiver(receiver_env(db, redis_url, WEBHOOK_SECRET), workers=2)
    bodies = [event_body() for _ in range(50)]
    acknowledged = {}

    for body in bodies:
        answer = receiver.post(body.encode(), _headers(body))
        if answer.status_code == 200:
            acknowledged[json.loads(body)["id"]] = (body, answer.json()["outcome"])
    receiver.kill()  # SIGKILL to master and workers: no shutdown, no flush, nothing after the last 200

    assert len(acknowledged) == len(bodies), receiver.log()
    for event_id, (body, outcome) in acknowledged.items():
        row = event_row(db, event_id)
        assert row is not None, f"{event_id} was acknowledged but is not in the ledger"
        assert (outcome, row["status"], row["payload"]) == ("received", "received", body)
    assert count_events(db) == len(bodies)


@pytest.mark.parametrize("worker_args", [
    pytest.param({"workers": 4}, id="4 sync workers"),
    pytest.param({"workers": 2, "extra_args": ("--worker-class", "gthread", "--threads", "10")}, id="2x10 threads"),
])
def test_twenty_concurrent_deliveries_of_one_event_to_the_real_receiver_make_one_row(
        db, redis_url, start_receiver, worker_args):
    # A connection per thread, so every copy a process holds can be inside its INSERT at once.
    receiver = start_receiver(receiver_env(db, redis_url, WEBHOOK_SECRET, DB_POOL_MAX_SIZE="10"), **worker_args)
    bodies = [event_body() for _ in range(ROUNDS)]

    for body in bodies:
        headers = [_headers(body) for _ in range(COPIES)]
        answers = deliver_at_once(lambda i: receiver.post(body.encode(), headers[i]), COPIES)

        assert sorted((a.status_code, a.json().get("outcome")) for a in answers) == (
            [(200, "duplicate")] * (COPIES - 1) + [(200, "received")]), receiver.log()
        row = event_row(db, json.loads(body)["id"])
        assert (row["status"], row["deliveries"], row["payload"]) == ("received", COPIES, body)
    assert count_events(db) == ROUNDS
