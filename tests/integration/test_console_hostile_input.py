"""Hostile input, on a real ledger: every filter of EventQuery, every console route and ledgerctl's event
filters answer arbitrary text, bytes, numbers and dates with a 4xx (or a non-zero exit) and a message, or
with their usual answer; never an exception or a 500, and a refused value changes nothing.

The first tests are the cases found by hand (NUL bytes, year-1 dates, ids past bigint); the property tests
(hypothesis) then feed arbitrary values to the same places. ``TESTING`` makes Flask raise a view's exception
into the test instead of answering 500, so an unexpected exception fails the example that caused it.
"""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from urllib.parse import quote, quote_from_bytes

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.console import ConsoleLedger
from ledger.event_query import EventQuery, FilterError
from ledger.operator import OperatorLedger
from tests.support.console import app, client_for, console_settings, failed_events, token_of  # noqa: F401
from tests.support.receiver import WakeupQueue  # noqa: F401  (the broker_settings fixture's queue)

FILTER_ARGS = ("status", "type", "reason", "source", "account", "livemode", "id", "since", "until", "after", "size")
QUERY_FIELDS = ("status", "type_glob", "reason", "source", "account", "livemode", "event_id", "since", "until")

# Values that broke something once, or sit on a boundary.
TRICKY = ["\x00", "\x00*", "%00", "0001-01-01T00:00", "0001-01-01T00:00+14:00", "9999-12-31T23:59:59-14:00",
          "9999-12-31T23:59:59.999999", "1969-12-31T23:59:59", "2026-01-01T00:00|\x00", "2026-01-01T00:00|", "|evt",
          "-1", "0", str(2 ** 63), "9" * 5000, "x" * 300, "", " ", "*", "%", "_", "\\", "'", '"', "platform", "live",
          "test", "failed_permanent", "processed", "webhook", "catchup", "thin", "\ud800", "\ufffd", "NaN", "1e999",
          "[" * 3000, "{}", "null"]
any_text = st.text(st.characters(exclude_categories=()), max_size=300)          # surrogates included
offsets = st.builds(lambda m: timezone(timedelta(minutes=m)), st.integers(-23 * 60 - 59, 23 * 60 + 59))
any_time = st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31, 23, 59, 59),
                        timezones=st.none() | offsets)
values = st.one_of(st.sampled_from(TRICKY), any_text, any_time.map(datetime.isoformat),
                   st.builds(lambda t, i: f"{t.isoformat()}|{i}", any_time, any_text))
# What a client can put in a URL or a form: any text percent-encoded as UTF-8 (a lone surrogate as the bytes
# it stands for), or any bytes at all.
encoded = st.one_of(values.map(lambda v: quote(v.encode("utf-8", "surrogatepass"), safe="")),
                    st.binary(max_size=60).map(lambda b: quote_from_bytes(b, safe="")))

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def operator(app, kit):
    """One logged-in operator and a CSRF token of its session, for every example of a property (a login per
    example would meet the throttle's address limit, which the /login examples' failures count towards)."""
    failed_events(kit, 2)
    client = client_for(app, "olga")
    return client, token_of(client, "/events")


def refused_with_a_reason(answer) -> bool:
    return 400 <= answer.status_code < 500 and (answer.status_code != 400 or 'id="error"' in answer.text)


# -- the cases found by hand ------------------------------------------------------------------------

@pytest.mark.parametrize("path", [
    "/events?id=%00", "/events?type=%00*", "/events?reason=%00", "/events?account=%00",
    "/events?after=2026-01-01T00:00|%00", "/events/%00", "/events?id=%00%ff", "/replay?id=%00",
    "/events?until=0001-01-01T00:00", "/replay?status=failed_permanent&until=0001-01-01T00:00",
    "/events?since=0001-01-01T00:00%2B14:00", "/events?until=9999-12-31T23:59:59-14:00", "/events?%00=x",
    "/events?size=" + "9" * 5000, "/outbox?status=%00", "/objects?id=%00", "/objects/%00", "/objects/cus_" + "a" * 10_000,
    "/objects?id=not%20an%20id", "/objects/cus_a%20b", "/objects?id=cus_" + "a" * 10_000,
])
def test_hostile_query_values_are_a_400_with_the_reason(app, path):
    answer = client_for(app, "olga").get(path)
    assert answer.status_code == 400 and 'id="error"' in answer.text, (path, answer.status_code)


def test_hostile_form_values_are_a_400_and_change_nothing(app, kit):
    (evt_id,) = failed_events(kit, 1)
    operator = client_for(app, "olga")
    token = token_of(operator, "/events")
    answer = operator.post(f"/events/{evt_id}/replay", data={"reason": "\x00", "csrf_token": token})
    assert answer.status_code == 400 and "NUL" in answer.text
    year_one = json.dumps({"status": "failed_permanent", "until": "0001-01-01T00:00:00+00:00"})
    answer = operator.post("/replay", data={"filter": year_one, "expected": "1", "confirm": "y",
                                            "preview": str(uuid.uuid4()), "csrf_token": token})
    assert answer.status_code == 400 and "between 1970-01-01" in answer.text
    assert kit.status(evt_id) == "failed_permanent"
    assert kit.query("SELECT (SELECT count(*) FROM ledger.replay_jobs) + (SELECT count(*) FROM ledger.audit) AS n") \
        == [{"n": 0}]


@pytest.mark.parametrize("args, says", [
    (["--type", "\x00"], "NUL"), (["--until", "0001-01-01T00:00"], "between 1970-01-01"),
    (["--since", "99999999999d"], "before any time"), (["--type", "\udcff"], "UTF-8"), (["--type", "x" * 300], "255"),
])
def test_ledgerctl_refuses_hostile_filters_with_exit_2_and_a_message(ledgerctl_cli, args, says):
    result = ledgerctl_cli("events", "list", *args, code=2)
    assert says in result.stderr


# -- the properties ---------------------------------------------------------------------------------

# Fields a query may well hold beside a hostile one, so that one value is tried at a time.
plausible = st.fixed_dictionaries({}, optional={
    "status": st.sampled_from(["failed_permanent", "processed"]), "type_glob": st.sampled_from(["test.*", "invoice.paid"]),
    "livemode": st.booleans(), "since": st.just("2026-11-01T00:00:00+00:00")})


@PROPERTY
@given(plain=plausible, field=st.sampled_from(QUERY_FIELDS),
       value=st.one_of(values, any_time, st.booleans(), st.integers(), st.none(), st.lists(st.integers(), max_size=2)))
def test_every_filter_of_an_event_query_is_refused_with_a_reason_or_runs(kit, plain, field, value):
    """Any value in any field: FilterError with a message, or a query Postgres runs, checked (the console's)
    and as given (ledgerctl's)."""
    fields = {**plain, field: value}
    try:
        query = EventQuery.from_json(fields)
    except FilterError as exc:
        assert str(exc)
        return
    console, operator = ConsoleLedger(kit.pool("console")), OperatorLedger(kit.pool("console"))
    operator.list_events(query, 3)
    list(operator.ids_for_replay(query, page=3))
    try:
        checked = query.checked()
    except FilterError as exc:
        assert str(exc)
        return
    console.page(checked, size=3)
    console.count(checked, cap=3)


@PROPERTY
@given(route=st.sampled_from(["/events", "/replay", "/outbox", "/", "/failures", "/replay/jobs", "/drift",
                              "/health-alerts", "/events/{}", "/replay/jobs/{}", "/login?next={}", "/objects",
                              "/objects/{}", "/objects/{}?stripe=1"]),
       query=st.dictionaries(st.sampled_from(FILTER_ARGS), encoded, max_size=6), segment=encoded)
def test_every_console_page_answers_any_query_without_a_500(operator, route, query, segment):
    answer = operator[0].get(route.format(segment) + "?" + "&".join(f"{k}={v}" for k, v in query.items()))
    assert answer.status_code < 400 or refused_with_a_reason(answer), (answer.status_code, answer.text[:300])


@PROPERTY
@given(route=st.sampled_from(["/events/{}/replay", "/replay", "/replay/jobs/{}/cancel", "/outbox/{}/replay",
                              "/drift", "/login", "/objects/{}/repair"]),
       form=st.dictionaries(st.sampled_from(["reason", "force", "expected", "confirm", "preview", "object_type",
                                             "account", "fix", "confirm_fix", "name", "password", "next",
                                             "scope"]),
                            encoded, max_size=6),
       fields=st.dictionaries(st.sampled_from((*QUERY_FIELDS, "colour")),
                              st.one_of(values, st.integers(), st.booleans(), st.none()), max_size=4),
       segment=encoded)
def test_every_console_form_answers_any_values_without_a_500_and_changes_nothing(operator, kit, route, form, fields,
                                                                                  segment):
    client, token = operator
    body = {**form, "csrf_token": token, "filter": quote(json.dumps(fields), safe="")}
    answer = client.post(route.format(segment), data="&".join(f"{k}={v}" for k, v in body.items()),
                         content_type="application/x-www-form-urlencoded")
    assert answer.status_code < 400 or refused_with_a_reason(answer), (answer.status_code, answer.text[:300])
    assert kit.query("SELECT (SELECT count(*) FROM ledger.audit) + (SELECT count(*) FROM ledger.object_repairs) AS n"
                     ) == [{"n": 0}]


@pytest.mark.parametrize("segment, form", [
    ("sub_a%00b", {"scope": "object", "confirm": "y"}), ("sub_" + "a" * 10_000, {"scope": "object", "confirm": "y"}),
    ("not%20an%20id", {"scope": "object", "confirm": "y"}), ("sub_known", {"scope": "customer", "confirm": "y"}),
    ("sub_known", {"scope": "%00", "confirm": "y"}), ("sub_known", {"scope": "object"}),
    ("evt_known", {"scope": "object", "confirm": "y"}), ("sub_nobody", {"scope": "object", "confirm": "y"}),
])
def test_hostile_repairs_are_refused_and_change_nothing(app, kit, segment, form):
    operator = client_for(app, "olga")
    token = token_of(operator, "/events")
    answer = operator.post(f"/objects/{segment}/repair", data="&".join(
        f"{k}={v}" for k, v in {**form, "csrf_token": token}.items()), content_type="application/x-www-form-urlencoded")
    assert refused_with_a_reason(answer), (answer.status_code, answer.text[:300])
    assert kit.query("SELECT count(*) AS n FROM ledger.object_repairs") == [{"n": 0}]


def test_a_viewer_cannot_repair_and_a_repair_needs_its_csrf_token(app, kit):
    viewer = client_for(app, "vera")
    answer = viewer.post("/objects/sub_known/repair", data={"scope": "object", "confirm": "y",
                                                            "csrf_token": token_of(viewer, "/events")})
    assert answer.status_code == 403
    operator = client_for(app, "olga")
    assert operator.post("/objects/sub_known/repair", data={"scope": "object", "confirm": "y"}).status_code == 400
    assert kit.query("SELECT count(*) AS n FROM ledger.object_repairs") == [{"n": 0}]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=st.dictionaries(st.sampled_from(["--type", "--since", "--until", "--status", "--limit"]),
                               st.one_of(values, st.integers().map(str)), max_size=4),
       command=st.sampled_from([("events", "list"), ("replay", "--status", "failed_permanent", "--dry-run")]))
def test_ledgerctl_event_filters_exit_with_a_message_never_an_exception(ledgerctl_cli, options, command):
    result = ledgerctl_cli(*command, "--json", *[part for option in options.items() for part in option], code=None)
    # 0: listed; 1: nothing to replay; 2: a usage error, which must say what.
    assert result.exit_code in (0, 1, 2)
    assert result.exit_code != 2 or "Error:" in result.stderr
