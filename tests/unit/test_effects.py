"""workers.effects without a network: how a backend's answer is classified, and how a call is signed
(checked against the test backend's verifier, tests/support/effect_endpoint.py)."""
from __future__ import annotations

import hashlib
import hmac
import time

import pytest

from tests.support.effect_endpoint import verify
from workers.effects import DeliveryFailed, _classify_status, sign


@pytest.mark.parametrize("status", [408, 409, 500, 502, 503, 504, 599])
def test_timeouts_conflicts_and_server_errors_are_recoverable(status):
    failure = _classify_status(status, None)
    assert isinstance(failure, DeliveryFailed)
    assert failure.permanent is False
    assert failure.reason == f"http_{status}"
    assert failure.retry_after_s is None


@pytest.mark.parametrize("retry_after, expected", [("7", 7.0), ("0.5", 0.5), ("0", 0.0), ("-3", 0.0), (None, None),
                                                   ("", None), ("Wed, 21 Oct 2015 07:28:00 GMT", None)])
def test_429_is_recoverable_and_honours_retry_after_seconds(retry_after, expected):
    failure = _classify_status(429, retry_after)
    assert failure.permanent is False
    assert failure.reason == "rate_limited"
    assert failure.retry_after_s == expected


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 410, 413, 422, 451])
def test_other_4xx_are_permanent_rejections(status):
    failure = _classify_status(status, "30")
    assert failure.permanent is True
    assert failure.reason == f"rejected_http_{status}"
    assert failure.retry_after_s is None


def test_sign_is_t_dot_body_hmac_sha256_and_a_backend_can_verify_it():
    body = b'{"id":"evt_1:entitlements.changed:cus_1","sequence":7}'
    secret = "outbox_test_secret_0123456789"
    mac = hmac.new(secret.encode(), b"1700000000." + body, hashlib.sha256).hexdigest()
    assert sign(body, secret, timestamp=1_700_000_000) == f"t=1700000000,v1={mac}"

    now = int(time.time())
    header = sign(body, secret)
    t, v1 = header.split(",")
    assert abs(int(t.removeprefix("t=")) - now) <= 2
    assert v1 == "v1=" + hmac.new(secret.encode(), t.removeprefix("t=").encode() + b"." + body,
                                  hashlib.sha256).hexdigest()
    # The test endpoint's verifier (what the e2e tests rely on) agrees, and refuses tampering.
    assert verify(header, body, secret)
    assert not verify(header, body + b" ", secret)
    assert not verify(header, body, secret + "x")
    assert not verify(sign(body, secret, timestamp=now - 3600), body, secret)
    assert not verify(None, body, secret)
