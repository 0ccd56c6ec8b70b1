"""The built-in webhook sender against a real local endpoint (loopback HTTP): what reaches the backend,
how each answer is classified, and that the test endpoint itself verifies, counts and deduplicates."""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from devkit.procs import free_port
from tests.support.effect_endpoint import SECRET
from workers.effects import DeliveryFailed, EffectDelivery, WebhookSender, load_senders, sign
from ledger.config import Settings


def _delivery(key: str = "evt_1:entitlements.changed:cus_1", sequence: int = 7) -> EffectDelivery:
    return EffectDelivery(sequence=sequence, idempotency_key=key, effect="entitlements.changed", event_id="evt_1",
                          ordering_key="cus_1", payload={"customer_id": "cus_1", "entitlements": ["seats"]})


def test_a_2xx_answer_delivers_and_the_backend_receives_a_signed_keyed_envelope(effect_endpoint):
    endpoint = effect_endpoint()
    sender = WebhookSender(endpoint.url, SECRET, timeout_s=5)
    sender(_delivery())  # no exception: delivered
    assert endpoint.applied_keys() == {"evt_1:entitlements.changed:cus_1"}
    assert endpoint.arrivals() == [{"id": "evt_1:entitlements.changed:cus_1", "type": "entitlements.changed",
                                    "sequence": 7, "ordering_key": "cus_1", "event_id": "evt_1",
                                    "data": {"customer_id": "cus_1", "entitlements": ["seats"]}}]
    assert endpoint.bad_signatures == 0 and endpoint.key_mismatches == 0

    # At-least-once: the same delivery again is answered 2xx and applied only once.
    sender(_delivery())
    assert endpoint.calls_total["evt_1:entitlements.changed:cus_1"] == 2
    assert endpoint.applied["evt_1:entitlements.changed:cus_1"] == 1
    assert endpoint.body_conflicts == []  # same key, byte-identical body
    assert endpoint.final_entitlements() == {"cus_1": ["seats"]}


@pytest.mark.parametrize("status", [200, 201, 202, 204])
def test_every_2xx_is_success(effect_endpoint, status):
    endpoint = effect_endpoint()
    endpoint.answer(status)
    WebhookSender(endpoint.url, SECRET, timeout_s=5)(_delivery())
    assert endpoint.answers == {status: 1} and endpoint.applied_keys() == {_delivery().idempotency_key}


@pytest.mark.parametrize("status, permanent, reason", [
    (503, False, "http_503"), (500, False, "http_500"), (408, False, "http_408"), (409, False, "http_409"),
    (422, True, "rejected_http_422"), (400, True, "rejected_http_400"), (404, True, "rejected_http_404")])
def test_error_answers_are_classified(effect_endpoint, status, permanent, reason):
    endpoint = effect_endpoint()
    endpoint.answer(status)
    with pytest.raises(DeliveryFailed) as failed:
        WebhookSender(endpoint.url, SECRET, timeout_s=5)(_delivery())
    assert (failed.value.permanent, failed.value.reason) == (permanent, reason)
    assert endpoint.applied_keys() == set()


def test_429_carries_the_backends_retry_after(effect_endpoint):
    endpoint = effect_endpoint()
    endpoint.answer(429, retry_after="3")
    with pytest.raises(DeliveryFailed) as failed:
        WebhookSender(endpoint.url, SECRET, timeout_s=5)(_delivery())
    assert (failed.value.permanent, failed.value.reason, failed.value.retry_after_s) == (False, "rate_limited", 3.0)


def test_a_wrong_secret_is_refused_by_the_backend_and_that_is_permanent(effect_endpoint):
    endpoint = effect_endpoint()
    with pytest.raises(DeliveryFailed) as failed:
        WebhookSender(endpoint.url, "not_the_backends_secret_0123", timeout_s=5)(_delivery())
    assert (failed.value.permanent, failed.value.reason) == (True, "rejected_http_401")
    assert endpoint.bad_signatures == 1 and endpoint.applied_keys() == set()


def test_the_endpoint_refuses_unsigned_and_tampered_calls(effect_endpoint):
    endpoint = effect_endpoint()
    body = json.dumps({"id": "k1", "type": "entitlements.changed", "sequence": 1, "ordering_key": "c",
                       "event_id": "e", "data": {"entitlements": []}}).encode()
    for header in (None, sign(body + b" ", SECRET), sign(body, SECRET).replace("v1=", "v1=00")):
        headers = {"Idempotency-Key": "k1", "Content-Type": "application/json"}
        if header:
            headers["Ledger-Signature"] = header
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(endpoint.url, data=body, headers=headers), timeout=5)
        assert refused.value.code == 401
    assert endpoint.bad_signatures == 3 and endpoint.applied_keys() == set()
    # The key header must be the effect's id.
    headers = {"Idempotency-Key": "other", "Ledger-Signature": sign(body, SECRET)}
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(endpoint.url, data=body, headers=headers), timeout=5)
    assert refused.value.code == 400 and endpoint.key_mismatches == 1


def test_a_timeout_is_recoverable_even_though_the_effect_landed_and_the_retry_applies_nothing_new(effect_endpoint):
    endpoint = effect_endpoint(timeout_fraction=1.0, timeout_sleep_s=1.5)
    sender = WebhookSender(endpoint.url, SECRET, timeout_s=0.3)
    with pytest.raises(DeliveryFailed) as failed:
        sender(_delivery())
    assert (failed.value.permanent, failed.value.reason) == (False, "network")
    assert endpoint.faults == {"timeout": 1}
    assert endpoint.applied_keys() == {_delivery().idempotency_key}  # it did land

    endpoint.heal()
    sender(_delivery())
    assert endpoint.calls_total[_delivery().idempotency_key] == 2
    assert endpoint.applied[_delivery().idempotency_key] == 1


def test_a_closed_port_is_recoverable_and_the_same_url_works_once_the_endpoint_binds_it(effect_endpoint):
    port = free_port()
    endpoint = effect_endpoint(port=port, start=False)
    sender = WebhookSender(endpoint.url, SECRET, timeout_s=2)
    with pytest.raises(DeliveryFailed) as failed:
        sender(_delivery())
    assert (failed.value.permanent, failed.value.reason) == (False, "network")

    endpoint.start()
    sender(_delivery())
    endpoint.down()
    with pytest.raises(DeliveryFailed):
        sender(_delivery(key="k2"))
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # really down
    endpoint.start()
    sender(_delivery(key="k2"))
    assert endpoint.applied_keys() == {_delivery().idempotency_key, "k2"}


def test_a_fault_fraction_is_capped_per_key(effect_endpoint):
    endpoint = effect_endpoint(fail_fraction=1.0, max_faults_per_key=2)
    sender = WebhookSender(endpoint.url, SECRET, timeout_s=5)
    reasons = []
    for _ in range(3):
        try:
            sender(_delivery())
            reasons.append("sent")
        except DeliveryFailed as exc:
            reasons.append(exc.reason)
    assert reasons == ["http_503", "http_503", "sent"]


def test_senders_exist_only_for_a_configured_webhook(effect_endpoint):
    assert load_senders(Settings()) == {}
    configured = load_senders(Settings(outbox_webhook_url="http://127.0.0.1:9/x", outbox_webhook_secret=SECRET,
                                       outbox_timeout_s=0.5))
    assert set(configured) == {"entitlements.changed", "invoice.payment_failed"}
    assert configured["entitlements.changed"] == WebhookSender("http://127.0.0.1:9/x", SECRET, 0.5)


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_and_not_taken_for_a_delivery(effect_endpoint, status):
    # A backend that answers with a redirect (http -> https, a moved route) has not taken the effect.
    # Following it would re-send the call as a GET without its body (301/302/303), and a 2xx from
    # wherever it leads would mark the effect sent though it never arrived.
    endpoint = effect_endpoint()
    endpoint.answer(status, location=endpoint.url + "/moved")
    with pytest.raises(DeliveryFailed) as failed:
        WebhookSender(endpoint.url, SECRET, timeout_s=5)(_delivery())
    assert (failed.value.permanent, failed.value.reason) == (True, f"rejected_http_{status}")
    assert endpoint.gets == 0 and endpoint.calls_total[_delivery().idempotency_key] == 1
