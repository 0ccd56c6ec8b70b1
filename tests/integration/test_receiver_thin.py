"""POST /webhooks/stripe/thin through the in-process receiver: a thin event notification, signed by one of its
event destinations' secrets, is recorded as it came (its own id, the context as the account, created to the
millisecond) and wakes a worker; the receiver calls no Stripe API for it. Bad or misplaced bodies get a 400 that
names the problem without echoing a value, and leave the ledger as it was."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import threading
import time
from datetime import datetime, timezone
from urllib.parse import urlsplit

import pytest

from devkit.factories import HEALTH_EVENT_TYPE, body_of, event, health_event, sign, thin_notification
from ledger.config import Settings
from tests.support.constants import WEBHOOK_SECRET
from tests.support.receiver import PAYLOAD_MARKER, ledger_snapshot
from tests.support.stripe_api import api_settings, fake_stripe  # noqa: F401

THIN = "/webhooks/stripe/thin"
SNAPSHOT = "/webhooks/stripe"
CONNECT = "/webhooks/stripe/connect"
THIN_SECRET = "whsec_test_thin_destination_one"
# A second event destination (say, of connected accounts) with its own secret, sending to the same URL.
OTHER_DESTINATION_SECRET = "whsec_test_thin_destination_two"
CONNECT_SECRET = "whsec_test_connect_0123456789"
ACCOUNT = "acct_1Connected"
CREATED = "2026-11-30T10:00:00.123Z"
T0 = 1_796_032_800  # CREATED's second
SUB = {"id": "sub_1Thin", "object": "subscription"}
SEED_ID = "evt_thin_seed_already_recorded"
LEDGER_ROWS = ("SELECT (SELECT count(*) FROM ledger.events) AS events, "
               "(SELECT count(*) FROM ledger.deliveries) AS deliveries")


@pytest.fixture
def thin_settings(settings):
    return dataclasses.replace(settings, thin_webhook_secrets=(THIN_SECRET, OTHER_DESTINATION_SECRET),
                               connect_webhook_secrets=(CONNECT_SECRET,))


@pytest.fixture
def client(thin_settings, make_receiver_app):
    return make_receiver_app(thin_settings).test_client()


def notification(event_type: str = "v1.customer.subscription.updated", **overrides) -> dict:
    n = thin_notification(event_type, related=SUB if event_type.startswith("v1.") else None, created=T0 + 0.123)
    n.update(overrides)
    return n


def post(client, path: str, body: str | dict, secret: str = THIN_SECRET):
    text = body if isinstance(body, str) else body_of(body)
    return client.post(path, data=text.encode(), headers={"Content-Type": "application/json",
                                                          "Stripe-Signature": sign(text, secret)})


def nothing_recorded(kit) -> bool:
    return kit.query(LEDGER_ROWS) == [{"events": 0, "deliveries": 0}]


# -- the endpoint exists while its secret is set ------------------------------------------------------

def test_the_thin_endpoint_is_404_while_its_secret_is_unset(kit, receiver_client):
    answer = post(receiver_client, THIN, notification(), THIN_SECRET)

    assert answer.status_code == 404
    assert answer.get_json()["error"] == "not_found"
    assert nothing_recorded(kit)


def test_a_receiver_of_thin_events_only_starts_and_its_snapshot_endpoint_is_404(kit, db, redis_url,
                                                                                make_receiver_app):
    settings = Settings.from_env({"DATABASE_URL": db, "CELERY_BROKER_URL": redis_url,
                                  "STRIPE_THIN_WEBHOOK_SECRET": THIN_SECRET})
    assert settings.webhook_secrets == ()
    client = make_receiver_app(settings).test_client()
    snapshot = event("customer.updated", {"id": "cus_1", "object": "customer"}, created=T0)

    # Not even a snapshot event signed by the thin secret gets through the snapshot endpoint.
    for secret in (THIN_SECRET, WEBHOOK_SECRET):
        answer = post(client, SNAPSHOT, snapshot, secret)
        assert (answer.status_code, answer.get_json()["error"]) == (404, "not_found")
    assert nothing_recorded(kit)
    assert post(client, THIN, notification(), THIN_SECRET).get_json()["outcome"] == "received"


# -- recorded as it came ------------------------------------------------------------------------------

def test_a_signed_notification_is_recorded_as_received_with_its_context_and_created_and_wakes_a_worker(
        kit, client, wakeup_queue):
    n = notification(context=ACCOUNT, reason={"type": "request", "request": {"id": "req_1", "idempotency_key": None}})
    body = json.dumps(n, indent=2)  # as Stripe formats it: the exact bytes matter

    answer = post(client, THIN, body)

    assert answer.status_code == 200, answer.get_json()
    assert answer.get_json() == {"outcome": "received", "event_id": n["id"], "status": "received", "enqueued": True}
    row = kit.query("SELECT type, status, account, livemode, api_version, stripe_created, payload::text AS payload "
                    "FROM ledger.events WHERE id = %s", (n["id"],))
    assert row == [{"type": "v1.customer.subscription.updated", "status": "received", "account": ACCOUNT,
                    "livemode": False, "api_version": None,
                    "stripe_created": datetime(2026, 11, 30, 10, 0, 0, 123000, tzinfo=timezone.utc),
                    "payload": body}]
    assert kit.query("SELECT source FROM ledger.deliveries") == [{"source": "webhook"}]
    assert wakeup_queue.messages() == [{"task": "workers.process_event", "args": [n["id"]], "kwargs": {}}]


def test_a_redelivery_is_a_duplicate_of_the_one_row_and_counts_as_a_second_delivery(kit, client):
    n = notification()
    first = post(client, THIN, n)
    again = post(client, THIN, n, OTHER_DESTINATION_SECRET)  # a new signature, the same bytes

    assert (first.get_json()["outcome"], again.get_json()["outcome"]) == ("received", "duplicate")
    assert again.get_json()["event_id"] == n["id"]
    assert kit.query(LEDGER_ROWS) == [{"events": 1, "deliveries": 2}]


@pytest.mark.parametrize("secret", [THIN_SECRET, OTHER_DESTINATION_SECRET])
def test_each_event_destinations_secret_verifies_at_the_thin_endpoint(kit, client, secret):
    n = notification()
    answer = post(client, THIN, n, secret)

    assert (answer.status_code, answer.get_json()["outcome"]) == (200, "received")
    assert kit.query("SELECT id FROM ledger.events") == [{"id": n["id"]}]


def test_the_thin_secrets_are_read_from_one_comma_separated_variable(kit, db, redis_url, make_receiver_app):
    settings = Settings.from_env({"DATABASE_URL": db, "CELERY_BROKER_URL": redis_url,
                                  "STRIPE_WEBHOOK_SECRET": WEBHOOK_SECRET,
                                  "STRIPE_THIN_WEBHOOK_SECRET": f"{THIN_SECRET}, {OTHER_DESTINATION_SECRET}"})
    client = make_receiver_app(settings).test_client()
    by_one, by_two = notification(), notification()

    assert post(client, THIN, by_one, THIN_SECRET).status_code == 200
    assert post(client, THIN, by_two, OTHER_DESTINATION_SECRET).status_code == 200
    assert {r["id"] for r in kit.query("SELECT id FROM ledger.events")} == {by_one["id"], by_two["id"]}


def test_each_endpoint_refuses_the_other_endpoints_secrets(kit, client):
    thin, snapshot = notification(), event("customer.updated", {"id": "cus_1", "object": "customer"}, created=T0)
    connected = event("customer.updated", {"id": "cus_2", "object": "customer"}, created=T0, account=ACCOUNT)

    refused = [post(client, THIN, thin, WEBHOOK_SECRET), post(client, THIN, thin, CONNECT_SECRET),
               post(client, SNAPSHOT, snapshot, THIN_SECRET),
               post(client, SNAPSHOT, snapshot, OTHER_DESTINATION_SECRET),
               post(client, CONNECT, connected, THIN_SECRET)]

    for answer in refused:
        assert answer.status_code == 400
        assert answer.get_json() == {"outcome": "invalid_signature",
                                     "error": "no configured secret verifies the Stripe-Signature header"}
    assert nothing_recorded(kit)
    assert post(client, THIN, thin, THIN_SECRET).status_code == 200
    assert post(client, SNAPSHOT, snapshot, WEBHOOK_SECRET).status_code == 200
    assert post(client, CONNECT, connected, CONNECT_SECRET).status_code == 200


# -- the wrong endpoint -------------------------------------------------------------------------------

def test_a_snapshot_event_at_the_thin_endpoint_is_refused_naming_the_snapshot_endpoint(kit, client):
    snapshot = event("customer.subscription.updated", {**SUB, "status": "active"}, created=T0)
    answer = post(client, THIN, snapshot)

    assert answer.status_code == 400
    assert answer.get_json() == {"outcome": "invalid_event",
                                 "error": "this is a snapshot event: its endpoint belongs at /webhooks/stripe"}
    assert nothing_recorded(kit)


@pytest.mark.parametrize("path, secret", [(SNAPSHOT, WEBHOOK_SECRET), (CONNECT, CONNECT_SECRET)])
def test_a_thin_notification_at_a_snapshot_endpoint_is_refused_naming_the_thin_endpoint(kit, client, path, secret):
    answer = post(client, path, notification(context=ACCOUNT), secret)

    assert answer.status_code == 400
    assert answer.get_json() == {"outcome": "invalid_event", "error": "this is a thin event notification: its event "
                                                                      "destination belongs at /webhooks/stripe/thin"}
    assert nothing_recorded(kit)


# -- types the worker decides about -------------------------------------------------------------------

def test_an_unknown_v2_type_is_recorded_for_the_worker_to_refuse(kit, client, wakeup_queue):
    n = notification("v2.money_management.payout.created")
    answer = post(client, THIN, n)

    assert (answer.status_code, answer.get_json()["outcome"]) == (200, "received")
    assert kit.event(n["id"])["type"] == "v2.money_management.payout.created"
    assert len(wakeup_queue) == 1


def test_the_health_event_without_a_related_object_is_recorded(kit, client):
    n, _ = health_event({"id": "in_1Lost", "object": "invoice"}, impact_event_type="invoice.paid", created=T0,
                        context=ACCOUNT)
    assert "related_object" not in n
    answer = post(client, THIN, n)

    assert (answer.status_code, answer.get_json()["outcome"]) == (200, "received")
    row = kit.event(n["id"])
    assert (row["type"], row["account"], row["status"]) == (HEALTH_EVENT_TYPE, ACCOUNT, "received")


# -- bad bodies: a 400, a reason, no echo, nothing recorded ----------------------------------------------

def _without(key: str, **overrides) -> dict:
    n = notification(id=SEED_ID, **overrides)
    del n[key]
    return n


def _related(url: str) -> dict:
    return notification(id=SEED_ID, related_object={"id": SUB["id"], "type": "subscription", "url": url})


BAD_CREATED = "'created' must be an ISO 8601 time with its zone (e.g. 2026-11-30T10:00:00.000Z)"
BAD_URL = "'related_object.url' must be a Stripe API path under /v1/"
# name -> (notification naming SEED_ID where it can, the reason). PAYLOAD_MARKER is in the bad value where it
# can be, else beside it.
BAD = {
    "created a unix timestamp": (notification(id=SEED_ID, created=T0), BAD_CREATED),
    "created without its zone": (notification(id=SEED_ID, created="2026-11-30T10:00:00.123"), BAD_CREATED),
    "created not a time": (notification(id=SEED_ID, created=PAYLOAD_MARKER), BAD_CREATED),
    "created missing": (_without("created"), BAD_CREATED),
    "a v1 type without related_object": (
        _without("related_object", description=PAYLOAD_MARKER),
        "'related_object' (id, type, url) is required in a v1.* thin event notification"),
    "related_object.url with a host": (_related(f"https://{PAYLOAD_MARKER}.example/v1/subscriptions/sub_1"), BAD_URL),
    "related_object.url of another host without a scheme": (_related(f"//{PAYLOAD_MARKER}.example/v1/x/y"), BAD_URL),
    "related_object.url with '..'": (_related(f"/v1/subscriptions/../{PAYLOAD_MARKER}/v2/core/events"), BAD_URL),
    "related_object.url not under /v1/": (_related(f"/v2/core/events/{PAYLOAD_MARKER}"), BAD_URL),
    "id not an event id": (notification(id="sub_" + PAYLOAD_MARKER),
                           "'id' must be a Stripe event id ('evt_' followed by letters, digits, '_' or '-')"),
    "context not printable": (notification(id=SEED_ID, context="acct_1\n" + PAYLOAD_MARKER),
                              "'context' must be a short printable string or null"),
    "object of another kind": (notification(id=SEED_ID, object="v2.core." + PAYLOAD_MARKER),
                               "body is not a Stripe thin event notification "
                               "(object 'v2.core.event' with id, type, created and livemode)"),
    "no object, a notification inside 'detail'": (
        {**_without("object"), "detail": notification(id=SEED_ID, description=PAYLOAD_MARKER)},
        "body is not a Stripe thin event notification (object 'v2.core.event' with id, type, created and livemode)"),
}


@pytest.fixture
def seeded(client):
    """The thin receiver with SEED_ID already recorded: a refused body naming it must not count as a delivery."""
    assert post(client, THIN, notification(id=SEED_ID)).get_json()["outcome"] == "received"
    return client


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_a_bad_notification_gets_400_with_its_reason_echoes_nothing_and_records_nothing(seeded, db, case):
    n, reason = BAD[case]
    body = body_of({**n, "description": PAYLOAD_MARKER} if PAYLOAD_MARKER not in body_of(n) else n)
    before = ledger_snapshot(db)

    answer = post(seeded, THIN, body)

    assert answer.status_code == 400
    assert answer.get_json() == {"outcome": "invalid_event", "error": reason}
    raw = answer.get_data()
    assert PAYLOAD_MARKER.encode() not in raw
    assert not any(s.encode() in raw for s in (THIN_SECRET, OTHER_DESTINATION_SECRET, WEBHOOK_SECRET))
    assert ledger_snapshot(db) == before


@pytest.mark.parametrize("accept, refused_livemode", [("test", True), ("live", False)])
def test_a_notification_of_a_mode_the_deployment_does_not_accept_is_refused_with_400_and_no_write(
        kit, thin_settings, make_receiver_app, accept, refused_livemode):
    client = make_receiver_app(dataclasses.replace(thin_settings, accept_livemode=accept)).test_client()
    refused = notification(livemode=refused_livemode, context=ACCOUNT)

    answer = post(client, THIN, refused)

    assert answer.status_code == 400
    assert answer.get_json() == {
        "outcome": "livemode_not_accepted", "event_id": refused["id"],
        "error": f"this deployment accepts {accept} mode events only (LEDGER_ACCEPT_LIVEMODE); nothing was recorded"}
    assert nothing_recorded(kit)
    accepted = notification(livemode=not refused_livemode)
    assert post(client, THIN, accepted).status_code == 200
    assert kit.query("SELECT id, livemode FROM ledger.events") == [{"id": accepted["id"],
                                                                   "livemode": not refused_livemode}]


def test_a_stale_signature_is_refused_at_the_thin_endpoint_too(kit, client):
    body = body_of(notification())
    answer = client.post(THIN, data=body, headers={"Stripe-Signature": sign(body, THIN_SECRET, int(time.time()) - 301)})

    assert answer.get_json() == {"outcome": "invalid_signature",
                                 "error": "signature timestamp outside the tolerance window"}
    assert nothing_recorded(kit)


# -- no Stripe API call --------------------------------------------------------------------------------

class SocketLog:
    """Where Python code resolves names and opens sockets while ``recording()``: an audit hook, so nothing of
    the code under test is replaced. (libpq opens Postgres' sockets itself: they are not seen.)"""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: list[tuple[str, tuple]] | None = None
        sys.addaudithook(self._audit)  # a hook cannot be removed: it keeps nothing outside recording()

    def _audit(self, name: str, args: tuple) -> None:
        if self._entries is not None and name in ("socket.connect", "socket.getaddrinfo"):
            where = args[1] if name == "socket.connect" else args[:2]
            with self._lock:
                self._entries.append((name, tuple(where) if isinstance(where, tuple) else (where, None)))

    @contextlib.contextmanager
    def recording(self):
        self._entries = entries = []
        try:
            yield entries
        finally:
            self._entries = None


SOCKETS = SocketLog()


def test_the_receiver_calls_no_stripe_api_even_with_a_key_and_an_api_base(kit, thin_settings, make_receiver_app,
                                                                          fake_stripe):
    configured = api_settings(thin_settings, fake_stripe)
    client = make_receiver_app(configured).test_client()
    sent = [notification(context=ACCOUNT), notification("v2.money_management.payout.created"),
            health_event({"id": "in_1", "object": "invoice"}, impact_event_type="invoice.paid", created=T0)[0],
            notification(created="not a time")]
    fake_stripe.clear_requests()

    with SOCKETS.recording() as seen:
        answers = [post(client, THIN, n).status_code for n in sent]
        answers.append(post(client, THIN, sent[0]).status_code)  # a duplicate

    assert answers == [200, 200, 200, 400, 200]
    assert fake_stripe.requests == []
    # Nor anywhere else (api.stripe.com, the library's default): the only socket opened is the broker's.
    broker = urlsplit(configured.broker_url)
    assert [(name, where) for name, where in seen if where[:2] != (broker.hostname, broker.port or 6379)] == []
    assert kit.query("SELECT count(*) AS n FROM ledger.events") == [{"n": 3}]
