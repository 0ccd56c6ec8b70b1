"""Connect and modes through the in-process receiver and worker: each endpoint verifies with its own secrets, a
connected account's events are applied to rows of that account (the platform's rows untouched), and a mode the
deployment does not accept is refused with a 400 and no write."""
from __future__ import annotations

import dataclasses

import pytest

from devkit.factories import SubscriptionHistory, body_of, event, sign
from tests.support.constants import WEBHOOK_SECRET
from workers.processor import Outcome

CONNECT_SECRET = "whsec_test_connect_0123456789"
ROLLED_CONNECT_SECRET = "whsec_test_connect_rolled_42"
ACCOUNT = "acct_1Connected"
OTHER_ACCOUNT = "acct_2Connected"
T0 = 1_760_000_000
LEDGER_ROWS = ("SELECT (SELECT count(*) FROM ledger.events) AS events, "
               "(SELECT count(*) FROM ledger.deliveries) AS deliveries")


@pytest.fixture
def connect_settings(settings):
    return dataclasses.replace(settings, connect_webhook_secrets=(CONNECT_SECRET, ROLLED_CONNECT_SECRET))


@pytest.fixture
def client(connect_settings, make_receiver_app):
    return make_receiver_app(connect_settings).test_client()


def post(client, path: str, evt: dict, secret: str):
    body = body_of(evt)
    return client.post(path, data=body, headers={"Stripe-Signature": sign(body, secret)})


def customer(customer_id: str, email: str) -> dict:
    return {"id": customer_id, "object": "customer", "email": email, "name": None, "metadata": {}}


def nothing_recorded(kit) -> bool:
    return kit.query(LEDGER_ROWS) == [{"events": 0, "deliveries": 0}]


# -- one secret list per endpoint --------------------------------------------------------------------

def test_the_connect_endpoint_is_404_while_its_secret_is_unset(kit, receiver_client):
    evt = event("customer.updated", customer("cus_c", "c@example.test"), created=T0, account=ACCOUNT)
    answer = post(receiver_client, "/webhooks/stripe/connect", evt, CONNECT_SECRET)

    assert answer.status_code == 404
    assert answer.get_json()["error"] == "not_found"
    assert nothing_recorded(kit)


@pytest.mark.parametrize("secret", [CONNECT_SECRET, ROLLED_CONNECT_SECRET])
def test_the_connect_endpoint_accepts_each_of_its_own_secrets(kit, client, secret):
    evt = event("customer.updated", customer("cus_c", "c@example.test"), created=T0, account=ACCOUNT)
    answer = post(client, "/webhooks/stripe/connect", evt, secret)

    assert answer.status_code == 200, answer.get_json()
    assert answer.get_json()["outcome"] == "received"
    assert kit.query("SELECT account FROM ledger.events") == [{"account": ACCOUNT}]
    assert kit.query("SELECT source FROM ledger.deliveries") == [{"source": "webhook"}]


def test_each_endpoint_refuses_the_other_endpoints_secret(kit, client):
    connected = event("customer.updated", customer("cus_c", "c@example.test"), created=T0, account=ACCOUNT)
    platform = event("customer.updated", customer("cus_p", "p@example.test"), created=T0)

    at_connect = post(client, "/webhooks/stripe/connect", connected, WEBHOOK_SECRET)
    at_platform = post(client, "/webhooks/stripe", platform, CONNECT_SECRET)

    for answer in (at_connect, at_platform):
        assert answer.status_code == 400
        assert answer.get_json()["outcome"] == "invalid_signature"
    assert nothing_recorded(kit)
    # Each with its own secret: both accepted.
    assert post(client, "/webhooks/stripe/connect", connected, CONNECT_SECRET).status_code == 200
    assert post(client, "/webhooks/stripe", platform, WEBHOOK_SECRET).status_code == 200


def test_the_connect_endpoint_refuses_an_event_that_names_no_account(kit, client):
    evt = event("customer.updated", customer("cus_c", "c@example.test"), created=T0)
    answer = post(client, "/webhooks/stripe/connect", evt, CONNECT_SECRET)

    assert answer.status_code == 400
    assert answer.get_json() == {"outcome": "invalid_event", "error": "'account' is required at the Connect "
                                                                      "endpoint: it names the connected account"}
    assert nothing_recorded(kit)


# -- rows per account ----------------------------------------------------------------------------------

def connected_history(account: str, *, livemode: bool = False) -> SubscriptionHistory:
    history = SubscriptionHistory().lifecycle()
    for evt in history.events:
        evt["account"] = account
        evt["livemode"] = livemode
    return history


def test_a_connected_accounts_events_write_rows_of_that_account_and_mode(kit, client):
    history = connected_history(ACCOUNT, livemode=True)
    summary = event("entitlements.active_entitlement_summary.updated", {
        "object": "entitlements.active_entitlement_summary", "customer": history.customer_id, "livemode": True,
        "entitlements": {"object": "list", "data": [{"id": "ent_1", "lookup_key": "sso", "feature": "feat_1"}]}},
        created=history.start + 5, livemode=True, account=ACCOUNT)
    active = history.events[:3]  # customer.created, subscription trialing, active: it grants its features
    processor = kit.processor(modules=())
    for evt in (*active, summary):
        assert post(client, "/webhooks/stripe/connect", evt, CONNECT_SECRET).status_code == 200
        assert processor.process(evt["id"]) is Outcome.PROCESSED, kit.event(evt["id"])

    assert kit.query("SELECT DISTINCT source, account FROM billing.entitlements ORDER BY source") == [
        {"source": "stripe", "account": ACCOUNT}, {"source": "subscription", "account": ACCOUNT}]
    assert kit.query("SELECT account FROM billing.entitlement_summaries") == [{"account": ACCOUNT}]
    for evt in history.events[3:]:
        assert post(client, "/webhooks/stripe/connect", evt, CONNECT_SECRET).status_code == 200
        assert processor.process(evt["id"]) is Outcome.PROCESSED, kit.event(evt["id"])
    for table in ("customers", "subscriptions", "invoices", "objects"):
        owners = kit.query(f"SELECT DISTINCT account, livemode FROM billing.{table}")
        assert owners == [{"account": ACCOUNT, "livemode": True}], table
    assert kit.query("SELECT DISTINCT account FROM billing.subscription_transitions") == [{"account": ACCOUNT}]
    assert kit.query("SELECT count(*) AS n FROM billing.objects") == [
        {"n": len({e["data"]["object"]["id"] for e in history.events})}]


def test_a_connected_accounts_event_never_touches_a_platform_row_of_the_same_id(kit, client):
    """Stripe's ids are unique across accounts, so this cannot happen with real events; if it did, the
    typed row is not moved to the connected account, whichever event is newer, and the event says why."""
    processor = kit.processor(modules=())
    platform = event("customer.updated", customer("cus_shared", "platform@example.test"), created=T0 + 10)
    newer = event("customer.updated", customer("cus_shared", "newer@example.test"), created=T0 + 20, account=ACCOUNT)
    older = event("customer.updated", customer("cus_shared", "older@example.test"), created=T0, account=ACCOUNT)
    assert post(client, "/webhooks/stripe", platform, WEBHOOK_SECRET).status_code == 200
    assert processor.process(platform["id"]) is Outcome.PROCESSED
    before = kit.query("SELECT * FROM billing.customers")
    mirror_before = kit.query("SELECT * FROM billing.objects WHERE account IS NULL")

    for evt in (newer, older):
        assert post(client, "/webhooks/stripe/connect", evt, CONNECT_SECRET).status_code == 200
        assert processor.process(evt["id"]) is Outcome.FAILED_PERMANENT
        row = kit.event(evt["id"])
        assert (row["failure_reason"], row["last_error"]) == (
            "constraint_violation", "SQLSTATE 23514 (CheckViolation): table=customers, constraint=billing_row_owner")

    assert kit.query("SELECT * FROM billing.customers") == before
    assert kit.query("SELECT * FROM billing.objects WHERE account IS NULL") == mirror_before
    assert kit.query("SELECT count(*) AS n FROM billing.objects") == [{"n": 1}]  # the refused events wrote nothing


def test_a_test_mode_event_never_touches_a_live_row_of_the_same_id(kit):
    processor = kit.processor(modules=())
    live = event("invoice.paid", {"id": "in_shared", "object": "invoice", "status": "paid"}, created=T0,
                 livemode=True)
    test = event("invoice.updated", {"id": "in_shared", "object": "invoice", "status": "void"}, created=T0 + 5)
    assert processor.process(kit.record(live)) is Outcome.PROCESSED
    assert processor.process(kit.record(test)) is Outcome.FAILED_PERMANENT
    assert kit.event(test["id"])["last_error"].endswith("table=invoices, constraint=billing_row_owner")
    assert kit.query("SELECT status, livemode FROM billing.invoices") == [{"status": "paid", "livemode": True}]


def test_an_object_several_accounts_see_is_mirrored_once_per_account(kit, client):
    """The Connect application (ca_...) is the object of every connected account's account.application.*
    events, and the platform may see it too: the mirror keeps each account's view apart."""
    processor = kit.processor(modules=())
    application = {"id": "ca_platform_app", "object": "application", "name": "Our platform"}
    events = [event("account.application.authorized", application, created=T0, account=ACCOUNT),
              event("account.application.deauthorized", application, created=T0 + 5, account=OTHER_ACCOUNT)]
    platform = event("application.updated", {**application, "name": "Renamed"}, created=T0 + 9)
    for evt in events:
        assert post(client, "/webhooks/stripe/connect", evt, CONNECT_SECRET).status_code == 200
    assert post(client, "/webhooks/stripe", platform, WEBHOOK_SECRET).status_code == 200
    for evt in (*events, platform):
        assert processor.process(evt["id"]) is Outcome.PROCESSED, kit.event(evt["id"])

    rows = kit.query("SELECT account, data->>'name' AS name, source_event_id FROM billing.objects "
                     "ORDER BY account NULLS FIRST")
    assert rows == [{"account": None, "name": "Renamed", "source_event_id": platform["id"]},
                    {"account": ACCOUNT, "name": "Our platform", "source_event_id": events[0]["id"]},
                    {"account": OTHER_ACCOUNT, "name": "Our platform", "source_event_id": events[1]["id"]}]


# -- accepted modes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("accept, refused_livemode", [("test", True), ("live", False)])
@pytest.mark.parametrize("path, secret, account", [("/webhooks/stripe", WEBHOOK_SECRET, None),
                                                   ("/webhooks/stripe/connect", CONNECT_SECRET, ACCOUNT)])
def test_an_event_of_a_mode_the_deployment_does_not_accept_is_refused_with_400_and_no_write(
        kit, connect_settings, make_receiver_app, accept, refused_livemode, path, secret, account):
    client = make_receiver_app(dataclasses.replace(connect_settings, accept_livemode=accept)).test_client()
    refused = event("customer.updated", customer("cus_m", "m@example.test"), created=T0,
                    livemode=refused_livemode, account=account)

    answer = post(client, path, refused, secret)

    assert answer.status_code == 400
    assert answer.get_json() == {
        "outcome": "livemode_not_accepted", "event_id": refused["id"],
        "error": f"this deployment accepts {accept} mode events only (LEDGER_ACCEPT_LIVEMODE); nothing was recorded"}
    assert nothing_recorded(kit)
    # Its redelivery is refused alike; an event of the accepted mode is recorded.
    assert post(client, path, refused, secret).status_code == 400
    accepted = event("customer.updated", customer("cus_m", "m@example.test"), created=T0,
                     livemode=not refused_livemode, account=account)
    assert post(client, path, accepted, secret).status_code == 200
    assert kit.query("SELECT id, livemode FROM ledger.events") == [{"id": accepted["id"],
                                                                   "livemode": not refused_livemode}]


def test_both_modes_are_accepted_by_default(kit, client):
    for livemode in (True, False):
        evt = event("customer.updated", customer(f"cus_{livemode}", "x@example.test"), created=T0, livemode=livemode)
        assert post(client, "/webhooks/stripe", evt, WEBHOOK_SECRET).status_code == 200
    assert kit.query("SELECT count(*) AS n FROM ledger.events") == [{"n": 2}]
