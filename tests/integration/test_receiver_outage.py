"""Postgres down: the receiver answers 503 (Stripe retries) and records nothing;
once Postgres is back, the redelivery is accepted. Uses a private server only."""
from __future__ import annotations

import json
import time

from ledger.config import Settings
from ledger.migrate import migrate
from devkit.factories import sign
from tests.support.constants import WEBHOOK_SECRET
from tests.support.receiver import PAYLOAD_MARKER, count_events, event_body, event_row

# Stripe retries a 503 for days; here redelivery is attempted until this deadline.
REDELIVERY_DEADLINE_S = 30


def _deliver(client, body: str):
    return client.post("/webhooks/stripe", data=body, headers={"Stripe-Signature": sign(body, WEBHOOK_SECRET)})


def test_a_delivery_during_a_postgres_outage_gets_503_and_its_redelivery_afterwards_is_recorded(
        private_postgres, redis_url, make_receiver_app):
    url = private_postgres.url
    migrate(url)
    client = make_receiver_app(Settings(
        database_url=url, broker_url=redis_url, webhook_secrets=(WEBHOOK_SECRET,), db_pool_timeout_s=1.0)
    ).test_client()
    before_outage = event_body()
    assert _deliver(client, before_outage).status_code == 200  # the pool holds a live connection now
    body = event_body()
    event_id = json.loads(body)["id"]

    private_postgres.stop()
    during = _deliver(client, body)

    assert during.status_code == 503
    assert during.get_json() == {"outcome": "unavailable", "event_id": event_id,
                                 "error": "ledger unavailable, retry later"}
    assert PAYLOAD_MARKER.encode() not in during.get_data()
    assert WEBHOOK_SECRET.encode() not in during.get_data()

    private_postgres.start()
    assert event_row(url, event_id) is None and count_events(url) == 1  # nothing of the 503 was recorded

    # Stripe redelivers until it gets a 2xx: every answer is 503 until one is 200.
    answers = []
    deadline = time.monotonic() + REDELIVERY_DEADLINE_S
    while time.monotonic() < deadline:
        answer = _deliver(client, body)
        answers.append(answer.status_code)
        if answer.status_code != 503:
            break
        time.sleep(0.2)
    assert answers[-1] == 200 and set(answers[:-1]) <= {503}, answers
    assert answer.get_json()["outcome"] == "received"
    row = event_row(url, event_id)
    assert (row["status"], row["deliveries"], row["payload"]) == ("received", 1, body)
