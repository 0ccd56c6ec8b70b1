"""ledger.stripe_events.parse_notification: what the receiver records of a thin event notification, and every
body it refuses (with a reason that never echoes a value of the body). Pure: no database, no server."""
from __future__ import annotations

import json

import pytest

from devkit.factories import HEALTH_EVENT_TYPE, body_of, event, thin_notification
from ledger.stripe_events import InvalidEvent, parse_event, parse_notification
from ledger.deliveries import IncomingEvent

T0 = 1_796_032_800  # 2026-11-30T10:00:00Z
SUB = {"id": "sub_1Thin", "object": "subscription"}
# Put into every refused value: no reason may contain it.
MARKER = "marker-0c4e91"

NOT_A_NOTIFICATION = ("body is not a Stripe thin event notification "
                      "(object 'v2.core.event' with id, type, created and livemode)")
BAD_CREATED = "'created' must be an ISO 8601 time with its zone (e.g. 2026-11-30T10:00:00.000Z)"
NO_RELATED_OBJECT = "'related_object' (id, type, url) is required in a v1.* thin event notification"
BAD_URL = "'related_object.url' must be a Stripe API path under /v1/"


def notification(**overrides) -> dict:
    n = thin_notification("v1.customer.subscription.updated", related=SUB, created=T0 + 0.123,
                          event_id="evt_thin_unit_1")
    n.update(overrides)
    return n


def text(n: dict) -> str:
    return json.dumps(n, indent=2)


def refusal(body: str | bytes) -> str:
    with pytest.raises(InvalidEvent) as refused:
        parse_notification(body.encode() if isinstance(body, str) else body)
    return str(refused.value)


# -- what is recorded ---------------------------------------------------------------------------------

def test_a_notification_is_recorded_under_its_id_with_created_to_the_millisecond_and_its_bytes_as_sent():
    body = text(notification(context="acct_1Connected", livemode=True))

    assert parse_notification(body.encode()) == IncomingEvent(
        id="evt_thin_unit_1", type="v1.customer.subscription.updated", created=T0 + 0.123, livemode=True,
        api_version=None, account="acct_1Connected", payload=body, object_id=SUB["id"])


def test_a_platform_notification_has_no_account():
    recorded = parse_notification(body_of(notification()).encode())
    assert (recorded.account, recorded.livemode, recorded.api_version) == (None, False, None)


@pytest.mark.parametrize("created, seconds", [
    ("2026-11-30T10:00:00.123Z", T0 + 0.123),
    ("2026-11-30T10:00:00Z", T0),
    ("2026-11-30T11:00:00.123+01:00", T0 + 0.123),  # another zone: the same instant
    ("2026-11-30T04:30:00.5-05:30", T0 + 0.5),
])
def test_created_is_read_in_its_own_zone(created, seconds):
    recorded = parse_notification(body_of(notification(created=created)).encode())
    assert recorded.created == pytest.approx(seconds, abs=1e-6)


@pytest.mark.parametrize("event_type", ["v2.money_management.payout.created", "v2.core.account.updated_unknown",
                                        "v3.something.new"])
def test_a_type_other_than_v1_is_recorded_without_a_related_object(event_type):
    """The worker decides which of these it supports (an unsupported one ends failed_permanent)."""
    n = notification(type=event_type)
    del n["related_object"]
    assert parse_notification(body_of(n).encode()).type == event_type


def test_the_health_event_has_no_related_object_and_is_recorded():
    n = thin_notification(HEALTH_EVENT_TYPE, created=T0, context="acct_1Connected")
    recorded = parse_notification(body_of(n).encode())
    assert (recorded.type, recorded.account) == (HEALTH_EVENT_TYPE, "acct_1Connected")


def test_a_v2_type_may_carry_a_related_object_of_a_v2_path():
    n = notification(type="v2.core.account.updated",
                     related_object={"id": "acct_1", "type": "v2.core.account", "url": "/v2/core/accounts/acct_1"})
    assert parse_notification(body_of(n).encode()).type == "v2.core.account.updated"


# -- the wrong endpoint -------------------------------------------------------------------------------

def test_a_snapshot_event_is_refused_naming_the_snapshot_endpoint():
    snapshot = event("customer.subscription.updated", {**SUB, "status": "active"}, created=T0)
    assert refusal(body_of(snapshot)) == "this is a snapshot event: its endpoint belongs at /webhooks/stripe"


def test_at_the_snapshot_endpoint_a_notification_is_refused_naming_the_thin_endpoint():
    with pytest.raises(InvalidEvent) as refused:
        parse_event(body_of(notification()).encode())
    assert str(refused.value) == ("this is a thin event notification: its event destination belongs at "
                                  "/webhooks/stripe/thin")


# -- refused bodies -----------------------------------------------------------------------------------

def _without(key: str, **overrides) -> str:
    n = notification(**overrides)
    del n[key]
    return text(n)


# name -> (body, reason)
REFUSED = {
    "not UTF-8": (b"\xff" + text(notification()).encode(), "body is not UTF-8"),
    "not JSON": ("id=evt_1&" + MARKER, "body is not valid JSON"),
    "JSON with NaN": (text(notification()).replace('"livemode": false', '"livemode": NaN'), "body is not valid JSON"),
    "JSON an array": (json.dumps([notification()]), "body is not a JSON object"),
    "no id": (_without("id"), "'id' must be a Stripe event id ('evt_' followed by letters, digits, '_' or '-')"),
    "id not an event id": (text(notification(id="sub_" + MARKER)),
                           "'id' must be a Stripe event id ('evt_' followed by letters, digits, '_' or '-')"),
    "type with a space": (text(notification(type="v1.customer " + MARKER)),
                          "'type' must be a Stripe event type (letters, digits, '.', '_', ':', '-')"),
    "no object": (_without("object"), NOT_A_NOTIFICATION),
    "object null": (text(notification(object=None)), NOT_A_NOTIFICATION),
    "object of another kind": (text(notification(object="v2.core.account")), NOT_A_NOTIFICATION),
    # The stripe library reads a cloud provider's envelope (EventBridge's 'detail', Event Grid's 'data'):
    # here a valid notification inside a body that is not one must not make that body pass.
    "a body without object carrying a notification in detail": (
        text({**json.loads(_without("object")), "detail": notification()}), NOT_A_NOTIFICATION),
    "a body of another object carrying a notification in an Event Grid envelope": (
        text(notification(object="v2.core.account", specversion="1.0", data=notification())), NOT_A_NOTIFICATION),
    "a v2 type the library knows, without the related_object it requires, notification in detail": (
        text({**json.loads(_without("related_object", type="v2.core.account.updated")), "detail": notification()}),
        NOT_A_NOTIFICATION),
    "reason not an object": (text(notification(reason=MARKER)), NOT_A_NOTIFICATION),
    "no created": (_without("created"), BAD_CREATED),
    "created a unix timestamp": (text(notification(created=T0)), BAD_CREATED),
    "created without its zone": (text(notification(created="2026-11-30T10:00:00.123")), BAD_CREATED),
    "created a date": (text(notification(created="2026-11-30")), BAD_CREATED),
    "created not a time": (text(notification(created=MARKER)), BAD_CREATED),
    "created before 1970": (text(notification(created="1969-12-31T23:59:59Z")), BAD_CREATED),
    "created past any date we store": (text(notification(created="9999-12-31T23:59:59Z")), BAD_CREATED),
    "created too long to be a time": (text(notification(created="2026-11-30T10:00:00." + "1" * 80 + "Z")),
                                      BAD_CREATED),
    "created null": (text(notification(created=None)), BAD_CREATED),
    "v1 type without related_object": (_without("related_object"), NO_RELATED_OBJECT),
    "v1 type with related_object null": (text(notification(related_object=None)), NO_RELATED_OBJECT),
    "v1 type with related_object a string": (text(notification(related_object="/v1/subscriptions/sub_1")),
                                             NO_RELATED_OBJECT),
    "v1 type with related_object without url": (
        text(notification(related_object={"id": "sub_1", "type": "subscription"})), NO_RELATED_OBJECT),
    "v1 type with related_object.url not a string": (
        text(notification(related_object={"id": "sub_1", "type": "subscription", "url": ["/v1/subscriptions"]})),
        NO_RELATED_OBJECT),
    "context not a string": (text(notification(context=["acct_1"])),
                             "'context' must be a short printable string or null"),
    "context with a NUL character": (text(notification(context="acct_1\u0000" + MARKER)),
                                     "'context' must not contain NUL characters"),
    "context not printable": (text(notification(context="acct_1\n" + MARKER)),
                              "'context' must be a short printable string or null"),
    "context too long": (text(notification(context="acct_" + "a" * 251)),
                         "'context' must be a short printable string or null"),
}

# related_object.url values a worker must never GET: they are refused with BAD_URL.
BAD_URLS = {
    "a host": f"https://{MARKER}.example/v1/subscriptions/sub_1",
    "a scheme-relative host": f"//{MARKER}.example/v1/subscriptions/sub_1",
    "a host at the start of the path": f"{MARKER}.example/v1/subscriptions/sub_1",
    "'..' out of /v1/": "/v1/subscriptions/../../v2/core/events/evt_1",
    "'..' inside /v1/": "/v1/subscriptions/../customers/cus_1",
    # A '.' segment is removed by the HTTP client before it sends: '/v1/subscriptions/.' would GET the list.
    "a '.' segment at the end": "/v1/subscriptions/.",
    "a '.' segment inside": "/v1/subscriptions/./sub_1",
    "a v2 path": "/v2/core/events/evt_1",
    "no path under /v1/": "/v1/",
    "a collection, not an object": "/v1/subscriptions",
    "a query": "/v1/subscriptions/sub_1?expand[]=customer",
    "a fragment": "/v1/subscriptions/sub_1#x",
    "percent-encoding": "/v1/subscriptions/%2e%2e/customers",
    "a trailing newline": "/v1/subscriptions/sub_1\n",
    "a backslash": "/v1/subscriptions\\sub_1",
    "empty": "",
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_a_body_that_is_not_a_notification_we_can_record_is_refused_saying_why(case):
    body, reason = REFUSED[case]
    message = refusal(body)
    assert message == reason
    assert MARKER not in message


@pytest.mark.parametrize("case", list(BAD_URLS), ids=list(BAD_URLS))
def test_a_related_object_url_other_than_an_api_path_under_v1_is_refused(case):
    url = BAD_URLS[case]
    message = refusal(text(notification(related_object={"id": "sub_1", "type": "subscription", "url": url})))
    assert message == BAD_URL
    assert MARKER not in message


@pytest.mark.parametrize("url", ["/v1/subscriptions/sub_1", "/v1/checkout/sessions/cs_test_a1",
                                 "/v1/subscription_items/si_1", "/v1/invoices/in_1-2.3"])
def test_an_api_path_under_v1_is_accepted(url):
    n = notification(related_object={"id": url.rsplit("/", 1)[1], "type": "x", "url": url})
    assert parse_notification(body_of(n).encode()).id == n["id"]


def test_a_notification_records_the_object_it_is_about_and_no_customer():
    recorded = parse_notification(body_of(notification()).encode())
    assert (recorded.object_id, recorded.customer_id) == (SUB["id"], None)
