"""Signed bodies at POST /webhooks/stripe/thin, fuzzed: never a 5xx; a 4xx is JSON with a reason, echoes nothing
and records nothing; a 200 records the body as it came, and a v1 notification it records points at a path the
worker's HTTP client sends as it is, under /v1/ on the configured API base.

Hypothesis drives the Flask test client of the real app (``ingest.app.create_app``) on the session's test
database. Every body is signed by the thin endpoint's secret, so each one reaches the parser: arbitrary bytes,
JSON of any shape, and thin notifications with fields dropped, replaced by any JSON value, or added (among
them the envelopes of cloud providers the stripe library would look inside).
"""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timedelta, timezone

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings as hypothesis_settings
from hypothesis import strategies as st

from devkit.factories import HEALTH_EVENT_TYPE, sign
from tests.support.receiver import CountingClient

THIN = "/webhooks/stripe/thin"
THIN_SECRET = "whsec_test_thin_fuzz_0123456789"
MARKER = "fuzz-thin-marker-51c2"
SEED_ID = "evt_fuzz_thin_seed"

FUZZ = hypothesis_settings(max_examples=150, deadline=None, database=None,
                           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                  HealthCheck.data_too_large, HealthCheck.large_base_example])

ACCEPTED = {"received", "duplicate"}
REFUSED = {"invalid_event", "invalid_signature", "livemode_not_accepted"}


class ThinReceiver(CountingClient):
    def row(self, event_id: str) -> tuple | None:
        return self.conn.execute("SELECT payload::text, account, type FROM ledger.events WHERE id = %s",
                                 (event_id,)).fetchone()

    def post(self, body: bytes):
        text = body.decode("utf-8", errors="replace")
        return self.client.post(THIN, data=body, headers={"Content-Type": "application/json",
                                                          "Stripe-Signature": sign(text, THIN_SECRET)})

    def check(self, body: bytes) -> tuple[dict, dict | None]:
        """POST ``body`` and check what every answer must be; (the JSON answer, the body's JSON if accepted)."""
        response = self.post(body)
        raw = response.get_data()
        assert response.status_code < 500, (response.status_code, raw[:300])
        assert response.mimetype == "application/json", response.mimetype
        answer = json.loads(raw)
        if response.status_code == 200:
            assert answer["outcome"] in ACCEPTED, answer
            notification = json.loads(body)
            before, self.baseline = self.baseline, self.counts()
            new_rows = 1 if answer["outcome"] == "received" else 0
            assert self.baseline == (before[0] + new_rows, before[1] + 1, before[2]), "one delivery, no attempt"
            payload, account, event_type = self.row(answer["event_id"])
            if answer["outcome"] == "received":
                assert (payload, account, event_type) == (body.decode("utf-8"), notification.get("context"),
                                                          notification["type"])
            return answer, notification
        assert response.status_code == 400, (response.status_code, raw[:300])
        assert answer["outcome"] in REFUSED and isinstance(answer.get("error"), str) and answer["error"], answer
        assert MARKER.encode() not in raw, "the answer echoes the payload"
        if len(body) >= 16:
            assert body not in raw, "the answer echoes the payload"
        assert self.counts() == self.baseline, "a refused body changed the ledger"
        return answer, None

    def close(self):
        self.conn.close()


@pytest.fixture
def receiver(settings, make_receiver_app, db):
    app = make_receiver_app(dataclasses.replace(settings, thin_webhook_secrets=(THIN_SECRET,)))
    r = ThinReceiver(app, db)
    # One notification already recorded: a refused body naming it must not count as its delivery.
    assert r.check(json.dumps(_notification(SEED_ID)).encode())[0]["outcome"] == "received"
    yield r
    r.close()


def _notification(event_id: str, event_type: str = "v1.customer.subscription.updated") -> dict:
    return {"id": event_id, "object": "v2.core.event", "type": event_type, "created": "2026-11-30T10:00:00.123Z",
            "livemode": False, "related_object": {"id": "sub_fuzz", "type": "subscription",
                                                  "url": "/v1/subscriptions/sub_fuzz"}}


# -- strategies -------------------------------------------------------------------------------------

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=40), st.just(MARKER))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=20)

zones = st.sampled_from([timezone.utc, timezone(timedelta(hours=5, minutes=30)),
                         timezone(-timedelta(hours=23, minutes=59)), timezone(timedelta(hours=14))])
iso_times = st.builds(
    lambda when, zulu: when.isoformat().replace("+00:00", "Z") if zulu else when.isoformat(),
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=zones), st.booleans())
created_values = st.one_of(iso_times, st.datetimes().map(datetime.isoformat),  # the second: no zone
                           st.text(max_size=40), json_values)

# Pieces a related_object.url is made of, hostile ones among them.
url_parts = st.sampled_from(["/v1/", "/v2/", "/", "//", "..", ".", "subscriptions", "sub_1", "checkout", "%2e", "%2F",
                             "?", "#", "\\", "http:", "https://", "evil.example", "@", ":", ";", " ", "\t", "\n",
                             "\u00e9", "\x00", "~", "-", "_", "v1"])
urls = st.one_of(st.lists(url_parts, max_size=8).map("".join),
                 st.lists(url_parts, max_size=4).map(lambda parts: "/v1/subscriptions/" + "".join(parts)),
                 st.text(max_size=60), st.just("/v1/subscriptions/sub_1"))
related_objects = st.one_of(
    st.fixed_dictionaries({"id": st.just("sub_1"), "type": st.just("subscription"), "url": urls}),
    st.fixed_dictionaries({"id": json_values, "type": json_values, "url": urls | json_values}),
    json_values)
types = st.one_of(st.sampled_from(["v1.customer.subscription.updated", "v1.invoice.paid", "v1.foo.bar",
                                   "v2.core.account.updated", "v2.money_management.payout.created",
                                   HEALTH_EVENT_TYPE, "v1.", "v2", "customer.updated"]),
                  st.text(max_size=30), json_values)
contexts = st.one_of(st.just("acct_1Fuzz"), st.just("acct_1Org/acct_2Fuzz"), st.text(max_size=40), json_values)
reasons = st.one_of(json_values, st.fixed_dictionaries({"type": st.just("request"), "request": json_values}))
FIELDS = {"object": st.one_of(st.just("v2.core.event"), st.just("event"), json_values),
          "type": types, "created": created_values, "livemode": json_values, "related_object": related_objects,
          "context": contexts, "reason": reasons,
          "id": st.one_of(st.text(max_size=30), st.just(SEED_ID), json_values)}


@st.composite
def notifications(draw) -> dict:
    """A thin notification with fields dropped, replaced by other values, or added."""
    n = _notification("evt_fuzz_" + draw(st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=8, max_size=24)),
                      draw(st.sampled_from(["v1.customer.subscription.updated", "v2.money_management.payout.created",
                                            HEALTH_EVENT_TYPE])))
    # Never dropped (a body without an id gets no further than the first check); replaced sometimes.
    for key in draw(st.lists(st.sampled_from(sorted(set(n) - {"id"})), unique=True, max_size=3)):
        del n[key]
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True, max_size=3)):
        n[key] = draw(FIELDS[key])
    # Fields of no thin notification: the envelopes of cloud providers, an object's snapshot.
    extra = draw(st.dictionaries(st.sampled_from(["detail", "specversion", "data", "changes", MARKER]),
                                 json_values | st.builds(_notification, st.just(SEED_ID)), max_size=2))
    return {**n, **extra}


def _text(n, indent) -> bytes:
    return json.dumps(n, indent=indent).encode()


bodies = st.one_of(
    st.binary(max_size=500),
    st.text(max_size=300).map(lambda s: (s + MARKER).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    notifications().map(lambda n: json.dumps(n).replace("false", "NaN", 1).encode()),
)


# -- the properties ----------------------------------------------------------------------------------

def _sent_as_is(url: str) -> bool:
    """Whether the worker's HTTP client sends ``url`` unchanged, as a path under /v1/ of the API base."""
    prepared = requests.Request("GET", "https://api.stripe.test" + url).prepare()
    return prepared.url == "https://api.stripe.test" + url and prepared.path_url == url and url.startswith("/v1/")


@FUZZ
@given(body=bodies)
def test_any_signed_body_at_the_thin_endpoint_is_answered_below_500_and_recorded_only_when_accepted(receiver, body):
    receiver.check(body)


@FUZZ
@given(n=notifications(), indent=st.sampled_from([None, 2]))
@example(n={**_notification("evt_fuzz_detail"), "object": None, "detail": _notification(SEED_ID)}, indent=None)
@example(n={**_notification("evt_fuzz_dot"), "related_object": {"id": "s", "type": "subscription",
                                                                 "url": "/v1/subscriptions/."}}, indent=None)
def test_any_signed_variant_of_a_notification_is_answered_below_500_and_recorded_only_when_it_is_one(
        receiver, n, indent):
    answer, recorded = receiver.check(_text(n, indent))
    if recorded is None:
        return
    assert recorded.get("object") == "v2.core.event"
    assert isinstance(recorded["created"], str)
    if recorded["type"].startswith("v1."):
        assert _sent_as_is(recorded["related_object"]["url"]), recorded["related_object"]


@FUZZ
@given(url=urls)
@example(url="/v1/subscriptions/.")
@example(url="/v1/subscriptions/%2e%2e/customers")
@example(url="/v1/subscriptions/sub_1 ")
def test_a_v1_notification_is_recorded_only_with_a_url_the_worker_sends_as_it_is(receiver, url):
    n = {**_notification("evt_fuzz_url_" + str(abs(hash(url)))),
         "related_object": {"id": "sub_1", "type": "subscription", "url": url}}
    answer, recorded = receiver.check(json.dumps(n).encode())
    if recorded is None:
        assert answer == {"outcome": "invalid_event",
                          "error": "'related_object.url' must be a Stripe API path under /v1/"}, (url, answer)
    else:
        assert _sent_as_is(url), url
