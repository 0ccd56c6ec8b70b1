"""The fake Stripe API's v2 side over real HTTP, through stripe-python the way workers fetch thin events:
v2 events by id and context (their 30-day window, Stripe's v2 404), ``Stripe-Context`` selecting a
connected account on /v1 too, conflicting account headers, faults on /v2 paths. No database: it lives
here because it starts a server."""
from __future__ import annotations

import pytest
import stripe

from devkit import factories
from devkit.factories import health_event, object_path, thin_notification, v2_event
from devkit.stripe_api import EVENT_RETENTION_S, FakeStripeControl
from tests.support.stripe_api import fake_stripe  # noqa: F401

NOW = 1_800_000_000
ACCT = "acct_1Connected"
OTHER = "acct_1Other"


@pytest.fixture
def fake(fake_stripe):  # noqa: F811
    fake_stripe.set_now(NOW)
    return fake_stripe


@pytest.fixture
def client(fake) -> stripe.StripeClient:
    return stripe.StripeClient(fake.api_key, base_addresses={"api": fake.base_url}, max_network_retries=0)


def stored_thin(fake, *, created: float = NOW - 60, context: str | None = ACCT) -> dict:
    n = thin_notification("v1.invoice.paid", related={"id": "in_1", "object": "invoice"}, created=created,
                          context=context)
    fake.add_v2_event(v2_event(n))
    return n


def get(client, path: str, **options) -> dict:
    return client.raw_request("get", path, **options).data


def status_of(client, path: str, **options) -> int:
    try:
        client.raw_request("get", path, **options)
    except stripe.StripeError as exc:
        return exc.http_status
    return 200


def test_a_v2_event_is_retrieved_by_id_in_its_context(fake, client):
    n = stored_thin(fake)
    answer = get(client, f"/v2/core/events/{n['id']}", stripe_context=ACCT)
    assert answer == {**n, "changes": None, "reason": None}
    assert fake.requests[-1].account == ACCT  # the context header named the account
    # What a worker does with a parsed notification: the library's own fetch sends the context.
    fetched = client.parse_event_notification_without_verification(factories.body_of(n)).fetch_event()
    assert (fetched.id, fetched.related_object.url) == (n["id"], "/v1/invoices/in_1")


def test_another_accounts_v2_event_is_stripes_v2_404_which_the_library_raises_with_status_404(fake, client):
    n = stored_thin(fake)
    for options in ({"stripe_context": OTHER}, {}):
        with pytest.raises(stripe.InvalidRequestError) as caught:
            client.raw_request("get", f"/v2/core/events/{n['id']}", **options)
        assert (caught.value.http_status, caught.value.code) == (404, "not_found")
        assert caught.value.json_body["error"]["type"] == "not_found"
    assert status_of(client, "/v2/core/events/evt_unknown", stripe_context=ACCT) == 404


def test_a_health_event_is_served_with_its_data_in_its_context(fake, client):
    n, v2 = health_event({"id": "in_1Lost", "object": "invoice"}, impact_event_type="invoice.paid",
                         created=NOW - 5.5, context=ACCT)
    fake.add_v2_event(v2)  # stored under its context
    answer = get(client, f"/v2/core/events/{n['id']}", stripe_context=ACCT)
    assert answer["data"]["impact"]["related_object"]["id"] == "in_1Lost"
    assert status_of(client, f"/v2/core/events/{n['id']}") == 404


def test_v2_events_leave_after_30_days_by_their_iso_created(fake, client):
    edge = stored_thin(fake, created=NOW - EVENT_RETENTION_S)
    older = stored_thin(fake, created=NOW - EVENT_RETENTION_S - 0.001)
    assert status_of(client, f"/v2/core/events/{edge['id']}", stripe_context=ACCT) == 200
    assert status_of(client, f"/v2/core/events/{older['id']}", stripe_context=ACCT) == 404
    fake.advance(1)
    assert status_of(client, f"/v2/core/events/{edge['id']}", stripe_context=ACCT) == 404


def test_a_v2_event_in_another_context_than_the_account_given_is_refused(fake):
    n = thin_notification("v1.invoice.paid", related={"id": "in_1", "object": "invoice"}, created=NOW,
                          context=ACCT)
    with pytest.raises(ValueError, match=ACCT):
        fake.add_v2_event(v2_event(n), account=OTHER)
    with pytest.raises(ValueError, match="ISO 8601"):
        fake.add_v2_event({**v2_event(n), "created": NOW})


def test_the_control_endpoint_stores_a_v2_event_under_its_context(fake, client):
    n = thin_notification("v1.invoice.paid", related={"id": "in_1", "object": "invoice"}, created=NOW,
                          context=ACCT)
    FakeStripeControl(fake.base_url).add_v2_event(v2_event(n))
    assert get(client, f"/v2/core/events/{n['id']}", stripe_context=ACCT)["id"] == n["id"]


def test_the_context_header_selects_a_connected_accounts_v1_objects(fake, client):
    objects = [factories.customer(created=NOW), factories.product(created=NOW),
               factories.price(created=NOW, product="prod_1"), factories.charge(created=NOW),
               factories.payment_intent(created=NOW), factories.refund(created=NOW, charge="ch_1", amount=100),
               factories.dispute(created=NOW, charge="ch_1", amount=100), factories.payment_method(created=NOW),
               *(e["data"]["object"] for e in
                 factories.SubscriptionHistory(api_version=factories.CLOVER_API).lifecycle().events[1:4])]
    fake.put_objects(objects, account=ACCT)
    latest = {obj["id"]: obj for obj in objects}  # the subscription's update replaced its creation
    for obj in latest.values():  # every related object url a factory builds is one the fake retrieves
        assert get(client, object_path(obj), stripe_context=ACCT) == obj
        assert get(client, object_path(obj), stripe_account=ACCT) == obj
        assert status_of(client, object_path(obj)) == 404  # not the platform's


def test_account_headers_naming_different_accounts_are_a_400(fake, client):
    fake.put_object(factories.customer(created=NOW, customer_id="cus_1"), account=ACCT)
    with pytest.raises(stripe.InvalidRequestError) as caught:
        client.raw_request("get", "/v1/customers/cus_1", stripe_account=ACCT, stripe_context=OTHER)
    assert caught.value.http_status == 400
    assert "Stripe-Account" in caught.value.user_message and "Stripe-Context" in caught.value.user_message
    n = stored_thin(fake)
    assert status_of(client, f"/v2/core/events/{n['id']}", stripe_account=OTHER, stripe_context=ACCT) == 400
    # The same account in both is that account.
    assert get(client, "/v1/customers/cus_1", stripe_account=ACCT, stripe_context=ACCT)["id"] == "cus_1"


def test_faults_apply_to_v2_paths(fake, client):
    n = stored_thin(fake)
    path = f"/v2/core/events/{n['id']}"
    fake.fail_next(1, status=503, path_prefix="/v2/")
    fake.fail_next(1, status=429, retry_after=0.5, path_prefix="/v2/core/events/")
    assert status_of(client, "/v1/events") == 200  # a /v1 request meets neither
    with pytest.raises(stripe.APIError) as unavailable:
        client.raw_request("get", path, stripe_context=ACCT)
    assert unavailable.value.http_status == 503
    with pytest.raises(stripe.RateLimitError) as limited:
        client.raw_request("get", path, stripe_context=ACCT)
    assert limited.value.headers["Retry-After"] == "0.5"
    assert get(client, path, stripe_context=ACCT)["id"] == n["id"]
    assert [r.status for r in fake.requests if r.path == path] == [503, 429, 200]


def test_a_slow_fault_delays_a_v2_answer_past_the_clients_timeout(fake):
    n = stored_thin(fake)
    impatient = stripe.StripeClient(fake.api_key, base_addresses={"api": fake.base_url}, max_network_retries=0,
                                    http_client=stripe.RequestsClient(timeout=0.2))
    fake.slow_next(1, seconds=1.0, path_prefix="/v2/")
    with pytest.raises(stripe.APIConnectionError):
        impatient.raw_request("get", f"/v2/core/events/{n['id']}", stripe_context=ACCT)
