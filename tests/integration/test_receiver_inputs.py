"""Bad input gets its 4xx and leaves the ledger exactly as it was; good signatures by any
configured secret are accepted.

Each bad request names the id of an event already in the ledger where it can, so a
receiver that wrongly counted it as a delivery would change that row too.
"""
from __future__ import annotations

import dataclasses
import json
import time

import pytest

from ledger.config import Settings
from devkit.factories import sign
from tests.support.constants import WEBHOOK_SECRET
from tests.support.receiver import PAYLOAD_MARKER, event_body, event_dict, event_row, ledger_snapshot

SEED_ID = "evt_seed_already_recorded"
UNKNOWN_SECRET = "whsec_unknown_to_the_receiver_42"
ONE_MIB = 1024 * 1024


def _without(key: str, **overrides) -> str:
    event = event_dict(SEED_ID, **overrides)
    del event[key]
    return json.dumps(event)


def _padded_event(size: int, event_id: str = "evt_sized") -> str:
    """A valid event whose JSON text is exactly `size` bytes."""
    base = json.dumps(event_dict(event_id, padding=""))
    body = base.replace('"padding": ""', '"padding": "' + "x" * (size - len(base.encode())) + '"')
    assert len(body.encode()) == size
    return body


def _signed(body: str | bytes, secret: str = WEBHOOK_SECRET, timestamp: int | None = None) -> dict:
    return {"Stripe-Signature": sign(body.decode() if isinstance(body, bytes) else body, secret, timestamp)}


def _post(body, headers=None, path="/webhooks/stripe"):
    return {"method": "POST", "path": path, "body": body, "headers": headers or {}}


def _signed_post(body: str, **kwargs):
    return _post(body, _signed(body, **kwargs))


# name -> (request builder, expected status, expected outcome). Builders run at test
# time, so signature timestamps are current.
BAD_INPUTS = {
    "missing Stripe-Signature header": (
        lambda: _post(event_body(SEED_ID)), 400, "invalid_signature"),
    "empty Stripe-Signature header": (
        lambda: _post(event_body(SEED_ID), {"Stripe-Signature": ""}), 400, "invalid_signature"),
    "signature of a different body": (
        lambda: _post(event_body(SEED_ID), _signed(event_body(SEED_ID, type="invoice.paid"))),
        400, "invalid_signature"),
    "signature by an unknown secret": (
        lambda: _post(event_body(SEED_ID), _signed(event_body(SEED_ID), secret=UNKNOWN_SECRET)),
        400, "invalid_signature"),
    "signature with a timestamp other than the signed one": (
        lambda: _post(event_body(SEED_ID), {"Stripe-Signature": sign(event_body(SEED_ID), WEBHOOK_SECRET).replace(
            "t=", "t=1", 1)}), 400, "invalid_signature"),
    "malformed header: free text": (
        lambda: _post(event_body(SEED_ID), {"Stripe-Signature": "not a stripe signature"}), 400, "invalid_signature"),
    "malformed header: timestamp not a number": (
        lambda: _post(event_body(SEED_ID), {"Stripe-Signature": "t=yesterday,v1=" + "0" * 64}),
        400, "invalid_signature"),
    "malformed header: no v1 signature": (
        lambda: _post(event_body(SEED_ID), {"Stripe-Signature": f"t={int(time.time())}"}), 400, "invalid_signature"),
    "malformed header: only a v0 signature": (
        lambda: _post(event_body(SEED_ID), {"Stripe-Signature": _signed(event_body(SEED_ID))["Stripe-Signature"]
                                            .replace("v1=", "v0=")}), 400, "invalid_signature"),
    "timestamp older than the default 300 s tolerance": (
        lambda: _signed_post(event_body(SEED_ID), timestamp=int(time.time()) - 301), 400, "invalid_signature"),
    "body not UTF-8": (
        lambda: _post(event_body(SEED_ID).encode().replace(b"customer.updated", b"customer.\xff\xfe"),
                      {"Stripe-Signature": f"t={int(time.time())},v1=" + "0" * 64}), 400, "invalid_signature"),
    "empty body": (lambda: _signed_post(""), 400, "invalid_event"),
    "body not JSON": (lambda: _signed_post("id=" + SEED_ID + "&type=customer.updated"), 400, "invalid_event"),
    "body truncated JSON": (lambda: _signed_post(event_body(SEED_ID)[:-2]), 400, "invalid_event"),
    "body with a byte order mark": (lambda: _signed_post("\ufeff" + event_body(SEED_ID)), 400, "invalid_event"),
    "JSON with NaN": (lambda: _signed_post(event_body(SEED_ID).replace('"pending_webhooks": 1', '"pending_webhooks": NaN')),
                      400, "invalid_event"),
    "JSON nested deeper than the parser allows": (
        lambda: _signed_post(event_body(SEED_ID).replace('"request": {', '"deep": ' + "[" * 5000 + "]" * 5000
                                                          + ', "request": {')), 400, "invalid_event"),
    "JSON an array, not an object": (lambda: _signed_post(json.dumps([event_dict(SEED_ID)])), 400, "invalid_event"),
    "JSON a string, not an object": (lambda: _signed_post(json.dumps(SEED_ID)), 400, "invalid_event"),
    "no id": (lambda: _signed_post(_without("id")), 400, "invalid_event"),
    "id not starting with evt_": (lambda: _signed_post(event_body("ch_" + SEED_ID)), 400, "invalid_event"),
    "id not a string": (lambda: _signed_post(event_body(12345)), 400, "invalid_event"),
    "id with a NUL character": (lambda: _signed_post(event_body(SEED_ID + "\u0000")), 400, "invalid_event"),
    "id longer than 255 characters": (lambda: _signed_post(event_body("evt_" + "a" * 252)), 400, "invalid_event"),
    "no type": (lambda: _signed_post(_without("type")), 400, "invalid_event"),
    "empty type": (lambda: _signed_post(event_body(SEED_ID, type="")), 400, "invalid_event"),
    "type not a string": (lambda: _signed_post(event_body(SEED_ID, type=["customer.updated"])), 400, "invalid_event"),
    "type with a NUL character": (lambda: _signed_post(event_body(SEED_ID, type="customer.updated\u0000")),
                                  400, "invalid_event"),
    "api_version with a NUL character": (lambda: _signed_post(event_body(SEED_ID, api_version="2024-06-20\u0000")),
                                         400, "invalid_event"),
    "account with a NUL character": (lambda: _signed_post(event_body(SEED_ID, account="acct_1\u0000")),
                                     400, "invalid_event"),
    "no data": (lambda: _signed_post(_without("data")), 400, "invalid_event"),
    "data not an object": (lambda: _signed_post(event_body(SEED_ID, data="cus_1")), 400, "invalid_event"),
    "no data.object": (lambda: _signed_post(event_body(SEED_ID, data={"previous_attributes": {}})), 400, "invalid_event"),
    "data.object not an object": (lambda: _signed_post(event_body(SEED_ID, data={"object": ["cus_1"]})),
                                  400, "invalid_event"),
    "data.object null": (lambda: _signed_post(event_body(SEED_ID, data={"object": None})), 400, "invalid_event"),
    "created missing": (lambda: _signed_post(_without("created")), 400, "invalid_event"),
    "created a string": (lambda: _signed_post(event_body(SEED_ID, created="1718000000")), 400, "invalid_event"),
    "created a float": (lambda: _signed_post(event_body(SEED_ID, created=1718000000.5)), 400, "invalid_event"),
    "created a boolean": (lambda: _signed_post(event_body(SEED_ID, created=True)), 400, "invalid_event"),
    "created negative": (lambda: _signed_post(event_body(SEED_ID, created=-1)), 400, "invalid_event"),
    "created beyond any date": (lambda: _signed_post(event_body(SEED_ID, created=10**20)), 400, "invalid_event"),
    "body one byte over the 1 MiB default limit": (
        lambda: _signed_post(_padded_event(ONE_MIB + 1)), 413, "rejected"),
    "GET on the webhook path": (
        lambda: {**_signed_post(event_body(SEED_ID)), "method": "GET"}, 405, "rejected"),
    "PUT on the webhook path": (
        lambda: {**_signed_post(event_body(SEED_ID)), "method": "PUT"}, 405, "rejected"),
    "DELETE on the webhook path": (
        lambda: {**_signed_post(event_body(SEED_ID)), "method": "DELETE"}, 405, "rejected"),
    "unknown path": (
        lambda: {**_signed_post(event_body(SEED_ID)), "path": "/webhooks/stripe/extra"}, 404, "rejected"),
    "POST on the health check": (
        lambda: {**_signed_post(event_body(SEED_ID)), "path": "/healthz"}, 405, "rejected"),
}


@pytest.fixture
def seeded(receiver_client, db):
    """A receiver whose ledger already holds SEED_ID (received once)."""
    body = event_body(SEED_ID)
    answer = receiver_client.post("/webhooks/stripe", data=body, headers=_signed(body))
    assert answer.status_code == 200 and answer.get_json()["outcome"] == "received"
    return receiver_client


def _send(client, request: dict):
    body = request["body"]
    return client.open(request["path"], method=request["method"],
                       data=body.encode() if isinstance(body, str) else body,
                       headers={"Content-Type": "application/json", **request["headers"]})


def _assert_rejection_reveals_nothing(answer, request: dict) -> None:
    data = answer.get_data()
    assert PAYLOAD_MARKER.encode() not in data
    assert WEBHOOK_SECRET.encode() not in data and UNKNOWN_SECRET.encode() not in data
    signature = request["headers"].get("Stripe-Signature", "")
    if len(signature) > 12:
        assert signature.encode() not in data
    assert answer.is_json, data[:200]


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_gets_its_4xx_and_leaves_the_ledger_unchanged(seeded, db, case):
    build, expected_status, expected_outcome = BAD_INPUTS[case]
    request = build()
    before = ledger_snapshot(db)

    answer = _send(seeded, request)

    assert answer.status_code == expected_status, answer.get_data()[:300]
    assert answer.get_json()["outcome"] == expected_outcome
    _assert_rejection_reveals_nothing(answer, request)
    assert ledger_snapshot(db) == before


def test_signature_errors_say_why_without_library_wording(seeded):
    reasons = {}
    for case in ("missing Stripe-Signature header", "malformed header: free text",
                 "timestamp older than the default 300 s tolerance", "signature by an unknown secret"):
        reasons[case] = _send(seeded, BAD_INPUTS[case][0]()).get_json()["error"]
    assert reasons == {
        "missing Stripe-Signature header": "missing Stripe-Signature header",
        "malformed header: free text": "malformed Stripe-Signature header",
        "timestamp older than the default 300 s tolerance": "signature timestamp outside the tolerance window",
        "signature by an unknown secret": "no configured secret verifies the Stripe-Signature header",
    }


@pytest.mark.parametrize("age_s, tolerance_s, expected_status", [
    (120, None, 200),   # inside the default 300 s
    (290, None, 200),
    (120, 60, 400),     # outside a configured 60 s
    (30, 60, 200),
])
def test_signature_tolerance_is_the_configured_one(settings, make_receiver_app, db, age_s, tolerance_s, expected_status):
    if tolerance_s is not None:
        settings = dataclasses.replace(settings, signature_tolerance_s=tolerance_s)
    client = make_receiver_app(settings).test_client()
    body = event_body()
    before = ledger_snapshot(db)

    answer = client.post("/webhooks/stripe", data=body, headers=_signed(body, timestamp=int(time.time()) - age_s))

    assert answer.status_code == expected_status
    if expected_status == 400:
        assert answer.get_json()["error"] == "signature timestamp outside the tolerance window"
        assert ledger_snapshot(db) == before
    else:
        assert answer.get_json()["outcome"] == "received"


@pytest.mark.parametrize("limit", [None, 2048], ids=["default 1 MiB", "configured 2048 bytes"])
def test_a_body_at_the_size_limit_is_recorded_and_one_byte_more_gets_413(settings, make_receiver_app, db, limit):
    if limit is not None:
        settings = dataclasses.replace(settings, max_body_bytes=limit)
    client = make_receiver_app(settings).test_client()
    at_limit = _padded_event(settings.max_body_bytes)
    over_limit = _padded_event(settings.max_body_bytes + 1, "evt_sized_over")

    accepted = client.post("/webhooks/stripe", data=at_limit, headers=_signed(at_limit))
    before = ledger_snapshot(db)
    rejected = client.post("/webhooks/stripe", data=over_limit, headers=_signed(over_limit))

    assert accepted.status_code == 200 and accepted.get_json()["outcome"] == "received"
    assert event_row(db, json.loads(at_limit)["id"])["payload"] == at_limit
    assert rejected.status_code == 413
    assert rejected.get_json()["outcome"] == "rejected"
    assert PAYLOAD_MARKER.encode() not in rejected.get_data()
    assert ledger_snapshot(db) == before


def test_either_secret_is_accepted_while_a_secret_is_rolled(db, redis_url, make_receiver_app):
    old, new = "whsec_old_0123456789abcdef", "whsec_new_fedcba9876543210"
    settings = Settings.from_env({"DATABASE_URL": db, "CELERY_BROKER_URL": redis_url,
                                  "STRIPE_WEBHOOK_SECRET": f"{old}, {new}"})
    client = make_receiver_app(settings).test_client()
    by_old, by_new, by_both, by_neither = (event_body() for _ in range(4))

    answers = {
        "old": client.post("/webhooks/stripe", data=by_old, headers=_signed(by_old, secret=old)),
        "new": client.post("/webhooks/stripe", data=by_new, headers=_signed(by_new, secret=new)),
        # While rolling on Stripe's side, one header carries a v1 signature per secret.
        "both": client.post("/webhooks/stripe", data=by_both, headers={"Stripe-Signature": (
            _signed(by_both, secret=UNKNOWN_SECRET)["Stripe-Signature"] + ","
            + _signed(by_both, secret=new)["Stripe-Signature"].split(",", 1)[1])}),
        "neither": client.post("/webhooks/stripe", data=by_neither, headers=_signed(by_neither, secret=UNKNOWN_SECRET)),
    }

    assert {k: (a.status_code, a.get_json()["outcome"]) for k, a in answers.items()} == {
        "old": (200, "received"), "new": (200, "received"), "both": (200, "received"),
        "neither": (400, "invalid_signature")}
    for body in (by_old, by_new, by_both):
        assert event_row(db, json.loads(body)["id"])["payload"] == body
    assert event_row(db, json.loads(by_neither)["id"]) is None
    assert old.encode() not in answers["neither"].get_data() and new.encode() not in answers["neither"].get_data()


@pytest.mark.parametrize("signer", ["old", "new"])
def test_a_stale_delivery_signed_by_either_rolled_secret_is_reported_as_outside_the_tolerance(
        settings, make_receiver_app, db, signer):
    secrets = {"old": "whsec_old_0123456789abcdef", "new": "whsec_new_fedcba9876543210"}
    client = make_receiver_app(dataclasses.replace(settings, webhook_secrets=tuple(secrets.values()))).test_client()
    body = event_body()
    before = ledger_snapshot(db)

    answer = client.post("/webhooks/stripe", data=body,
                         headers=_signed(body, secret=secrets[signer], timestamp=int(time.time()) - 3600))

    assert answer.status_code == 400
    assert answer.get_json() == {"outcome": "invalid_signature",
                                 "error": "signature timestamp outside the tolerance window"}
    assert ledger_snapshot(db) == before
