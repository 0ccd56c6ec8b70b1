"""/healthz, /readyz and /metrics of the receiver."""
from __future__ import annotations

import dataclasses
import re

from prometheus_client.parser import text_string_to_metric_families

from devkit.factories import sign
from devkit.procs import free_port
from tests.support.constants import WEBHOOK_SECRET
from tests.support.receiver import event_body


def test_healthz_answers_200_without_touching_any_dependency(settings, make_receiver_app):
    nothing_up = dataclasses.replace(settings, database_url=f"postgresql://postgres@127.0.0.1:{free_port()}/x",
                                     broker_url=f"redis://127.0.0.1:{free_port()}/0")
    answer = make_receiver_app(nothing_up).test_client().get("/healthz")

    assert answer.status_code == 200
    assert answer.get_json() == {"status": "ok"}


def test_readyz_answers_200_when_postgres_and_the_broker_are_reachable(receiver_client):
    answer = receiver_client.get("/readyz")

    assert answer.status_code == 200
    assert answer.get_json() == {"ready": True, "checks": {"postgres": True, "broker": True}}


def test_readyz_answers_503_naming_the_broker_when_the_broker_is_unreachable(settings, make_receiver_app):
    broker_down = dataclasses.replace(settings, broker_url=f"redis://127.0.0.1:{free_port()}/0")
    answer = make_receiver_app(broker_down).test_client().get("/readyz")

    assert answer.status_code == 503
    assert answer.get_json() == {"ready": False, "checks": {"postgres": True, "broker": False}}


def test_readyz_answers_503_naming_postgres_when_postgres_is_unreachable(settings, make_receiver_app):
    # Nothing listens on this port: no server is stopped for this.
    pg_down = dataclasses.replace(settings, database_url=f"postgresql://postgres@127.0.0.1:{free_port()}/ledger",
                                  db_pool_timeout_s=0.5)
    answer = make_receiver_app(pg_down).test_client().get("/readyz")

    assert answer.status_code == 503
    assert answer.get_json() == {"ready": False, "checks": {"postgres": False, "broker": True}}


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_is_prometheus_text_counting_requests_by_outcome(receiver_client):
    def scrape():
        answer = receiver_client.get("/metrics")
        assert answer.status_code == 200
        assert answer.content_type.startswith("text/plain")
        return _samples(answer.get_data(as_text=True))

    body = event_body()
    before = scrape()
    receiver_client.post("/webhooks/stripe", data=body, headers={"Stripe-Signature": sign(body, WEBHOOK_SECRET)})
    receiver_client.post("/webhooks/stripe", data=body, headers={"Stripe-Signature": sign(body, WEBHOOK_SECRET)})
    receiver_client.post("/webhooks/stripe", data=body, headers={"Stripe-Signature": "t=1,v1=00"})
    after = scrape()

    def delta(outcome):
        key = ("ingest_requests_total", (("outcome", outcome),))
        return after.get(key, 0) - before.get(key, 0)

    assert (delta("received"), delta("duplicate"), delta("invalid_signature")) == (1, 1, 1)
    assert any(name == "ingest_request_seconds_count" for name, _ in after)


def test_metrics_text_has_no_payload_or_secret(receiver_client):
    body = event_body()
    receiver_client.post("/webhooks/stripe", data=body, headers={"Stripe-Signature": sign(body, WEBHOOK_SECRET)})

    text = receiver_client.get("/metrics").get_data(as_text=True)

    assert re.search(r"^ingest_requests_total\{outcome=\"received\"\} \d", text, re.MULTILINE)
    assert WEBHOOK_SECRET not in text and "evt_" not in text
