"""The fake Stripe API, driven by the real stripe library (the way the product will call Stripe).

In-process servers on 127.0.0.1 and one ``python -m devkit.stripe_api`` process; no database.
"""
from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import pytest
import stripe

from devkit import factories
from devkit.stripe_api import EVENT_RETENTION_S, FakeStripe, FakeStripeControl, FakeStripeProcess, parse_query

API_KEY = "sk_test_unit_fake_0123"
NOW = 1_800_000_000


@pytest.fixture
def fake():
    with FakeStripe.serving(API_KEY) as running:
        running.set_now(NOW)
        yield running


def client_of(base_url: str, **options) -> stripe.StripeClient:
    return stripe.StripeClient(API_KEY, base_addresses={"api": base_url}, **options)


@pytest.fixture
def client(fake):
    return client_of(fake.base_url)


def evt(event_type: str, created: int, event_id: str, **kwargs) -> dict:
    obj_type = "subscription" if ".subscription." in event_type else event_type.split(".")[0]
    return factories.event(event_type, {"id": f"{obj_type[:3]}_{event_id}", "object": obj_type}, created=created,
                           event_id=event_id, **kwargs)


def raw_get(fake, path: str, headers: dict | None = None, *, auth: bool = True) -> tuple[int, dict, dict]:
    headers = {**({"Authorization": f"Bearer {API_KEY}"} if auth else {}), **(headers or {})}
    request = urllib.request.Request(fake.base_url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, dict(answer.headers), json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


@pytest.fixture
def same_second_events(fake):
    """12 events in 3 seconds, added out of created order; the order Stripe would list them in."""
    seconds = [NOW - 30, NOW - 50, NOW - 40, NOW - 50, NOW - 30, NOW - 40] * 2
    added = []
    for i, created in enumerate(seconds):
        added.append((created, i, f"evt_{i:02d}"))
        fake.add_event(evt("customer.updated", created, f"evt_{i:02d}"))
    return [event_id for _, _, event_id in sorted(added, reverse=True)]


# -- paging ---------------------------------------------------------------------------------

def test_events_are_newest_first_and_same_second_events_later_added_first(fake, client, same_second_events):
    listed = [e.id for e in client.v1.events.list({"limit": 5}).auto_paging_iter()]

    assert listed == same_second_events
    assert listed[:4] == ["evt_10", "evt_06", "evt_04", "evt_00"]  # the four of NOW-30, later added first
    assert [r.query.get("starting_after") for r in fake.requests] == [None, listed[4], listed[9]]


def test_a_page_says_whether_more_follow(client, same_second_events):
    first = client.v1.events.list({"limit": 5})
    last = client.v1.events.list({"limit": 5, "starting_after": same_second_events[6]})

    assert first.has_more and [e.id for e in first.data] == same_second_events[:5]
    assert not last.has_more and [e.id for e in last.data] == same_second_events[7:]


def test_ending_before_pages_toward_newer_events_nearest_first(fake, client, same_second_events):
    oldest = same_second_events[-1]
    page = client.v1.events.list({"limit": 2, "ending_before": same_second_events[6]})
    top = client.v1.events.list({"limit": 5, "ending_before": same_second_events[2]})
    forward = [e.id for e in client.v1.events.list({"limit": 5, "ending_before": oldest}).auto_paging_iter()]

    assert [e.id for e in page.data] == same_second_events[4:6] and page.has_more
    assert [e.id for e in top.data] == same_second_events[:2] and not top.has_more
    assert forward == list(reversed(same_second_events[:-1]))  # oldest first, as a catch-up reads them


def test_bad_cursors_and_limits_are_400(client, same_second_events):
    for params, param in [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "ten"}, "limit"),
                          ({"starting_after": "evt_unknown"}, "starting_after"),
                          ({"ending_before": "evt_unknown"}, "ending_before")]:
        with pytest.raises(stripe.InvalidRequestError) as raised:
            client.v1.events.list(params)
        assert (raised.value.http_status, raised.value.param) == (400, param)
    with pytest.raises(stripe.InvalidRequestError):
        client.v1.events.list({"starting_after": same_second_events[0], "ending_before": same_second_events[1]})

    assert len(client.v1.events.list({"limit": 100}).data) == 12
    assert len(client.v1.events.list().data) == 10  # Stripe's default limit


# -- what /v1/events selects ------------------------------------------------------------------

def test_only_events_of_the_last_30_days_are_listed_or_retrieved(fake, client):
    fake.add_event(evt("customer.created", NOW - EVENT_RETENTION_S - 1, "evt_gone"))
    fake.add_event(evt("customer.created", NOW - EVENT_RETENTION_S + 10, "evt_oldest"))

    assert [e.id for e in client.v1.events.list().data] == ["evt_oldest"]
    assert client.v1.events.retrieve("evt_oldest").id == "evt_oldest"
    with pytest.raises(stripe.InvalidRequestError) as raised:
        client.v1.events.retrieve("evt_gone")
    assert raised.value.http_status == 404 and raised.value.code == "resource_missing"

    fake.advance(11)
    assert client.v1.events.list().data == []
    with pytest.raises(stripe.InvalidRequestError):
        client.v1.events.retrieve("evt_oldest")


def test_type_filters_exact_wildcard_and_types(fake, client):
    types = ["customer.created", "customer.updated", "customer.subscription.created",
             "customer.subscription.deleted", "invoice.paid"]
    for i, event_type in enumerate(types):
        fake.add_event(evt(event_type, NOW - 100 + i, f"evt_{i}"))

    def listed(params):
        return sorted(e.type for e in client.v1.events.list(params).data)

    assert listed({"type": "invoice.paid"}) == ["invoice.paid"]
    assert listed({"type": "customer.subscription.*"}) == ["customer.subscription.created",
                                                           "customer.subscription.deleted"]
    assert listed({"type": "customer.*"}) == sorted(types[:4])
    assert listed({"types": ["invoice.paid", "customer.created"]}) == ["customer.created", "invoice.paid"]
    assert fake.requests[-1].query["types"] == ["invoice.paid", "customer.created"]
    with pytest.raises(stripe.InvalidRequestError) as raised:
        client.v1.events.list({"types": [f"t.{i}" for i in range(21)]})
    assert raised.value.param == "types"
    assert listed({"types": [f"t.{i}" for i in range(19)] + ["invoice.paid"]}) == ["invoice.paid"]
    with pytest.raises(stripe.InvalidRequestError):
        client.v1.events.list({"type": "invoice.paid", "types": ["invoice.paid"]})


def test_created_filters(fake, client):
    for i in range(5):
        fake.add_event(evt("invoice.paid", NOW - 100 + i, f"evt_{i}"))

    def ids(params):
        return [e.id for e in client.v1.events.list(params).data]

    assert ids({"created": {"gte": NOW - 99, "lt": NOW - 97}}) == ["evt_2", "evt_1"]
    assert ids({"created": {"gt": NOW - 99, "lte": NOW - 97}}) == ["evt_3", "evt_2"]
    assert ids({"created": NOW - 96}) == ["evt_4"]
    assert raw_get(fake, f"/v1/events?created[after]={NOW}")[0] == 400


def test_delivery_success_filter(fake, client):
    fake.add_event(evt("invoice.paid", NOW - 10, "evt_ok"))
    fake.add_event(evt("invoice.paid", NOW - 9, "evt_failed"), delivered=False)

    assert [e.id for e in client.v1.events.list({"delivery_success": False}).data] == ["evt_failed"]
    assert [e.id for e in client.v1.events.list({"delivery_success": True}).data] == ["evt_ok"]
    assert fake.requests[-1].query["delivery_success"] == "true"


def test_both_array_encodings_decode_alike(fake):
    fake.add_event(evt("invoice.paid", NOW - 10, "evt_a"))
    fake.add_event(evt("customer.created", NOW - 9, "evt_b"))
    fake.add_event(evt("customer.updated", NOW - 8, "evt_c"))

    assert parse_query("types%5B0%5D=a&types%5B1%5D=b&created%5Bgte%5D=5") == {"types": ["a", "b"],
                                                                             "created": {"gte": "5"}}
    assert parse_query("types[]=a&types[]=b&limit=3") == {"types": ["a", "b"], "limit": "3"}
    status, _, page = raw_get(fake, "/v1/events?types[]=invoice.paid&types[]=customer.created")
    assert status == 200 and [e["id"] for e in page["data"]] == ["evt_b", "evt_a"]


def test_unknown_parameters_urls_and_methods_are_stripe_errors(fake, client):
    with pytest.raises(stripe.InvalidRequestError) as raised:
        client.v1.events.list({"kind": "invoice.paid"})
    assert raised.value.http_status == 400 and raised.value.param == "kind"
    status, _, body = raw_get(fake, "/v1/nothing_here")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"


# -- objects --------------------------------------------------------------------------------

def test_objects_list_newest_first_and_retrieve(fake, client):
    old = factories.customer(created=NOW - 500, customer_id="cus_old")
    tied = [factories.customer(created=NOW - 100, customer_id=f"cus_tie{i}") for i in range(3)]
    fake.put_objects([tied[0], old, tied[1], tied[2]])
    fake.put_object(factories.charge(created=NOW, customer="cus_old", charge_id="ch_1"))
    fake.put_object({**old, "email": "new@example.test"})  # an update keeps its place

    listed = [c.id for c in client.v1.customers.list({"limit": 2}).auto_paging_iter()]
    assert listed == ["cus_tie2", "cus_tie1", "cus_tie0", "cus_old"]
    assert client.v1.customers.retrieve("cus_old").email == "new@example.test"
    with pytest.raises(stripe.InvalidRequestError) as raised:
        client.v1.charges.retrieve("cus_old")  # an id of another type is no charge
    assert raised.value.http_status == 404
    assert [c.id for c in client.v1.charges.list({"customer": "cus_old"}).data] == ["ch_1"]
    assert client.v1.charges.list({"customer": "cus_tie0"}).data == []


def test_a_deleted_customer_retrieves_as_stripes_stub_and_leaves_lists(fake, client):
    fake.put_object(factories.customer(created=NOW - 5, customer_id="cus_gone"))
    fake.put_object(factories.product(created=NOW - 5, product_id="prod_gone"))
    fake.delete_object("cus_gone")
    fake.delete_object("prod_gone")

    status, _, body = raw_get(fake, "/v1/customers/cus_gone")
    assert (status, body) == (200, {"id": "cus_gone", "object": "customer", "deleted": True})
    assert client.v1.customers.retrieve("cus_gone").to_dict().get("deleted") is True
    assert client.v1.customers.list().data == []
    with pytest.raises(stripe.InvalidRequestError):
        client.v1.products.retrieve("prod_gone")


def test_subscriptions_list_hides_canceled_unless_asked(fake, client):
    statuses = ["active", "trialing", "canceled", "incomplete_expired", "past_due"]
    for i, status in enumerate(statuses):
        fake.put_object({"id": f"sub_{status}", "object": "subscription", "status": status, "created": NOW - 10 + i,
                         "customer": "cus_a" if i % 2 == 0 else "cus_b",
                         "items": {"object": "list", "data": [{"id": f"si_{i}", "object": "subscription_item",
                                                               "price": {"id": f"price_{i % 2}"}}]}})

    def listed(params=None):
        return sorted(s.status for s in client.v1.subscriptions.list(params).auto_paging_iter())

    assert listed() == sorted(set(statuses) - {"canceled"})
    assert listed({"status": "all"}) == sorted(statuses)
    assert listed({"status": "canceled"}) == ["canceled"]
    assert listed({"status": "ended"}) == ["canceled", "incomplete_expired"]
    assert listed({"status": "all", "customer": "cus_a"}) == ["active", "canceled", "past_due"]
    assert listed({"customer": "cus_a"}) == ["active", "past_due"]
    assert listed({"status": "all", "price": "price_1"}) == ["incomplete_expired", "trialing"]
    with pytest.raises(stripe.InvalidRequestError) as raised:
        client.v1.subscriptions.list({"status": "gone"})
    assert raised.value.param == "status"


def test_collection_filters_follow_stripes_fields(fake, client):
    fake.put_objects([
        {"id": "in_old", "object": "invoice", "created": NOW - 3, "customer": "cus_a", "subscription": "sub_1"},
        {"id": "in_basil", "object": "invoice", "created": NOW - 2, "customer": "cus_a", "subscription": None,
         "parent": {"type": "subscription_details", "subscription_details": {"subscription": "sub_1"}}},
        {"id": "in_other", "object": "invoice", "created": NOW - 1, "customer": "cus_b", "subscription": "sub_2"},
        factories.price(created=NOW, product="prod_1", price_id="price_1"),
        factories.price(created=NOW, product="prod_2", price_id="price_2", interval=None),
        factories.refund(created=NOW, charge="ch_1", amount=5, refund_id="re_1"),
        factories.dispute(created=NOW, charge="ch_2", amount=5, dispute_id="dp_1"),
        {"id": "cs_1", "object": "checkout.session", "created": NOW, "customer": "cus_a", "status": "complete"},
    ])

    assert [i.id for i in client.v1.invoices.list({"subscription": "sub_1"}).data] == ["in_basil", "in_old"]
    assert [p.id for p in client.v1.prices.list({"product": "prod_2"}).data] == ["price_2"]
    assert [p.id for p in client.v1.prices.list({"type": "recurring"}).data] == ["price_1"]
    assert [r.id for r in client.v1.refunds.list({"charge": "ch_1"}).data] == ["re_1"]
    assert client.v1.disputes.list({"charge": "ch_1"}).data == []
    assert [s.id for s in client.v1.checkout.sessions.list({"customer": "cus_a"}).data] == ["cs_1"]
    assert client.v1.checkout.sessions.retrieve("cs_1").status == "complete"
    assert raw_get(fake, "/v1/subscription_items")[0] == 400  # Stripe requires subscription=


def test_connected_accounts_see_only_their_own(fake, client):
    fake.add_event(evt("invoice.paid", NOW - 5, "evt_platform"))
    for i in range(3):
        fake.add_event(evt("invoice.paid", NOW - 4 + i, f"evt_acct_{i}", account="acct_1"))  # its own field
    fake.put_object(factories.customer(created=NOW, customer_id="cus_acct"), account="acct_1")
    acct = {"stripe_account": "acct_1"}

    paged = list(client.v1.events.list({"limit": 2}, acct).auto_paging_iter())
    assert [e.id for e in paged] == ["evt_acct_2", "evt_acct_1", "evt_acct_0"]
    assert {e.account for e in paged} == {"acct_1"}
    assert {r.account for r in fake.requests} == {"acct_1"} and len(fake.requests) == 2  # every page
    assert [e.id for e in client.v1.events.list().data] == ["evt_platform"]
    assert client.v1.customers.retrieve("cus_acct", None, acct).id == "cus_acct"
    with pytest.raises(stripe.InvalidRequestError):
        client.v1.customers.retrieve("cus_acct")
    assert client.v1.events.list(None, {"stripe_account": "acct_2"}).data == []
    with pytest.raises(ValueError):
        fake.add_event(evt("invoice.paid", NOW, "evt_x", account="acct_1"), account="acct_2")


# -- faults and authentication -------------------------------------------------------------------

def test_429_is_a_rate_limit_error_with_retry_after_and_the_library_does_not_retry_it(fake):
    fake.add_event(evt("invoice.paid", NOW - 5, "evt_1"))
    fake.fail_next(1, status=429, retry_after=7)
    client = client_of(fake.base_url, max_network_retries=2)

    with pytest.raises(stripe.RateLimitError) as raised:
        client.v1.events.list()
    assert raised.value.http_status == 429 and raised.value.json_body["error"]["code"] == "rate_limit"
    assert raised.value.headers["Retry-After"] == "7"
    assert [e.id for e in client.v1.events.list().data] == ["evt_1"]
    assert [r.status for r in fake.requests] == [429, 200]


def test_500_is_an_api_error_and_every_library_retry_is_counted(fake):
    fake.fail_next(2, status=500)
    with pytest.raises(stripe.APIError) as raised:
        client_of(fake.base_url).v1.events.list()  # a StripeClient retries nothing unless told
    assert raised.value.http_status == 500

    assert client_of(fake.base_url, max_network_retries=1).v1.events.list().data == []
    assert [r.status for r in fake.requests] == [500, 500, 200]


def test_faults_can_be_limited_to_a_path(fake, client):
    fake.put_object(factories.customer(created=NOW, customer_id="cus_1"))
    fake.fail_next(1, status=503, path_prefix="/v1/customers")

    assert client.v1.events.list().data == []
    with pytest.raises(stripe.APIError):
        client.v1.customers.retrieve("cus_1")
    assert client.v1.customers.retrieve("cus_1").id == "cus_1"
    assert [(r.path, r.status) for r in fake.requests] == [("/v1/events", 200), ("/v1/customers/cus_1", 503),
                                                          ("/v1/customers/cus_1", 200)]


def test_slow_answers_delay_and_can_time_a_client_out(fake):
    fake.slow_next(1, 0.3)
    started = time.monotonic()
    client_of(fake.base_url).v1.events.list()
    assert time.monotonic() - started >= 0.3

    fake.slow_next(1, 5.0)
    impatient = client_of(fake.base_url, http_client=stripe.RequestsClient(timeout=0.2))
    started = time.monotonic()
    with pytest.raises(stripe.APIConnectionError):
        impatient.v1.events.list()
    assert time.monotonic() - started < 2
    started = time.monotonic()
    fake.stop()  # wakes the sleeping answer instead of waiting it out
    assert time.monotonic() - started < 2


def test_a_wrong_or_missing_api_key_is_401(fake):
    with pytest.raises(stripe.AuthenticationError) as raised:
        stripe.StripeClient("sk_test_wrong", base_addresses={"api": fake.base_url}).v1.events.list()
    assert raised.value.http_status == 401
    status, _, body = raw_get(fake, "/v1/events", auth=False)
    assert status == 401 and set(body["error"]) >= {"type", "message"}


def test_v2_events_are_served_by_id(fake):
    fake.add_v2_event({"id": "evt_v2_1", "object": "v2.core.event", "type": "v1.billing.meter.error_report_triggered"})
    assert raw_get(fake, "/v2/core/events/evt_v2_1")[2]["type"] == "v1.billing.meter.error_report_triggered"
    assert raw_get(fake, "/v2/core/events/evt_v2_2")[0] == 404


# -- out of process ---------------------------------------------------------------------------------

CONTROLLED_ELSEWHERE = {"api_key", "base_url", "serving", "start", "stop", "state", "load_state"}


def test_the_control_client_offers_the_in_process_methods():
    in_process = {name for name in dir(FakeStripe) if not name.startswith("_")} - CONTROLLED_ELSEWHERE
    assert in_process <= set(dir(FakeStripeControl))


def test_a_fake_in_another_process_is_driven_over_http_and_stops_on_sigterm(tmp_path):
    state = tmp_path / "state.json"
    process = FakeStripeProcess(tmp_path, api_key=API_KEY, state=state).start()
    try:
        control = process.control
        control.set_now(NOW)
        control.add_events([evt("invoice.paid", NOW - 10, "evt_1"), evt("invoice.paid", NOW - 9, "evt_2")])
        control.add_event(evt("invoice.paid", NOW - 8, "evt_3"), account="acct_1", delivered=False)
        control.put_object(factories.customer(created=NOW, customer_id="cus_1"))
        control.fail_next(1, status=429, retry_after=1, path_prefix="/v1/events")
        client = client_of(process.base_url)

        with pytest.raises(stripe.RateLimitError):
            client.v1.events.list()
        assert [e.id for e in client.v1.events.list({"limit": 1}).auto_paging_iter()] == ["evt_2", "evt_1"]
        assert client.v1.events.list({"delivery_success": False}, {"stripe_account": "acct_1"}).data[0].id == "evt_3"
        control.delete_object("cus_1")
        assert client.v1.customers.retrieve("cus_1").to_dict().get("deleted") is True
        assert control.advance(EVENT_RETENTION_S - 9.5) == control.now
        assert [e.id for e in client.v1.events.list().data] == ["evt_2"]
        assert [(r.status, r.account) for r in control.requests] == [(429, None), (200, None), (200, None),
                                                                     (200, "acct_1"), (200, None), (200, None)]
        process.proc.send_signal(signal.SIGTERM)
        assert process.proc.wait(timeout=5) == 0
    finally:
        process.stop()

    again = FakeStripeProcess(tmp_path, api_key=API_KEY, state=state).start()  # --state kept what it had
    try:
        again.control.set_now(NOW)
        assert [e.id for e in client_of(again.base_url).v1.events.list().data] == ["evt_2", "evt_1"]
        again.proc.send_signal(signal.SIGINT)
        assert again.proc.wait(timeout=5) == 0
    finally:
        again.stop()


def test_the_control_client_reports_a_bad_request(fake):
    with pytest.raises(RuntimeError, match="400"):
        FakeStripeControl(fake.base_url).add_event({"id": "evt_no_created"})
