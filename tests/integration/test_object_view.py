"""ledgerctl objects show: one object's events and its rows live | rebuilt | Stripe (workers/object_view.py).

A planted wrong row shows live ≠ rebuilt = Stripe; a missed event shows live = rebuilt ≠ Stripe; an
unknown id is "not in the ledger" (exit 1); a hostile id is refused (exit 2) before any read."""
from __future__ import annotations

import dataclasses
import json

import pytest

from devkit.factories import SubscriptionHistory
from tests.support.stripe_api import env_of, fake_stripe  # noqa: F401

HISTORY = SubscriptionHistory(start=1_700_000_000).lifecycle()


def process(kit, events: list[dict]) -> None:
    processor = kit.processor(waker=None)
    for evt_id in kit.record_many(events):
        assert processor.process(evt_id).value == "processed", kit.event(evt_id)


def show(ledgerctl_cli, object_id: str, *args: str, env: dict | None = None, code: int = 0) -> dict:
    result = ledgerctl_cli("objects", "show", object_id, "--json", *args, env=env, code=code)
    return json.loads(result.stdout)


def rows_of(story: dict, table: str) -> list[dict]:
    return next(t["rows"] for t in story["tables"] if t["table"] == table)


def latest_object(events: list[dict], object_id: str) -> dict:
    return [e for e in events if e["data"]["object"]["id"] == object_id][-1]["data"]["object"]


def test_a_subscriptions_story_lists_its_events_in_stripes_order_and_links_its_customer_and_invoices(
        kit, ledgerctl_cli):
    process(kit, HISTORY.events)
    story = show(ledgerctl_cli, HISTORY.subscription_id)

    mine = [e for e in HISTORY.events if e["data"]["object"]["id"] == HISTORY.subscription_id]
    assert [e["id"] for e in story["events"]] == [e["id"] for e in mine]
    assert {e["status"] for e in story["events"]} == {"processed"}
    assert all(e["deliveries"] == 1 and e["replays"] == 0 and e["attempts"] == 1 for e in story["events"])
    assert story["object"] == "subscription"
    assert story["links"]["customer"] == [HISTORY.customer_id]
    [sub] = rows_of(story, "billing.subscriptions")
    assert sub["differs"] == [] and sub["live"]["status"] == "canceled" and sub["rebuilt"] == sub["live"]
    transitions = rows_of(story, "billing.subscription_transitions")
    assert len(transitions) == len(mine) and all(t["differs"] == [] for t in transitions)

    customer = show(ledgerctl_cli, HISTORY.customer_id)
    assert customer["links"]["subscriptions"] == [HISTORY.subscription_id]
    assert set(customer["links"]["invoices"]) == {e["data"]["object"]["id"] for e in HISTORY.events
                                                  if e["type"].startswith("invoice.")}
    assert [e["type"] for e in customer["events"]] == ["customer.created"]


def test_transitions_delivered_out_of_order_show_where_they_differ_from_stripes_order(kit, ledgerctl_cli):
    """A transition says what the row held when its event came: delivered in reverse, the rebuilt ones
    (in Stripe's order) differ in from_status and applied, and the page says so; the row itself does not."""
    process(kit, list(reversed(HISTORY.events)))
    story = show(ledgerctl_cli, HISTORY.subscription_id)
    assert rows_of(story, "billing.subscriptions")[0]["differs"] == []
    transitions = rows_of(story, "billing.subscription_transitions")
    assert {c for t in transitions for c in t["differs"]} == {"from_status", "applied"}


def test_a_planted_wrong_row_shows_live_unlike_rebuilt_and_stripe(kit, ledgerctl_cli, fake_stripe):  # noqa: F811
    events = HISTORY.events[:9]  # ends active
    process(kit, events)
    kit.execute("UPDATE billing.subscriptions SET status = 'past_due' WHERE id = %s", (HISTORY.subscription_id,))
    fake_stripe.put_object(latest_object(events, HISTORY.subscription_id))

    story = show(ledgerctl_cli, HISTORY.subscription_id, "--stripe", env=env_of(fake_stripe))

    assert story["stripe"]["error"] is None
    [sub] = rows_of(story, "billing.subscriptions")
    assert sub["live"]["status"] == "past_due"
    assert sub["rebuilt"]["status"] == sub["stripe"]["status"] == "active"
    assert sub["differs"] == ["status"]
    assert [r["differs"] for r in rows_of(story, "billing.objects")] == [[]]


def test_a_missed_event_shows_live_and_rebuilt_unlike_stripe(kit, ledgerctl_cli, fake_stripe):  # noqa: F811
    process(kit, HISTORY.events[:9])  # the cancellation never arrived
    fake_stripe.put_object(latest_object(HISTORY.events, HISTORY.subscription_id))

    story = show(ledgerctl_cli, HISTORY.subscription_id, "--stripe", env=env_of(fake_stripe))

    [sub] = rows_of(story, "billing.subscriptions")
    assert sub["live"] == sub["rebuilt"] and sub["live"]["status"] == "active"
    assert sub["stripe"]["status"] == "canceled"
    assert "status" in sub["differs"]


def test_a_failed_fetch_is_shown_and_the_rest_of_the_story_still_is(kit, ledgerctl_cli, fake_stripe):  # noqa: F811
    process(kit, HISTORY.events[:3])
    # Stripe has no such object.
    story = show(ledgerctl_cli, HISTORY.subscription_id, "--stripe", env=env_of(fake_stripe))
    assert "404" in story["stripe"]["error"] and story["stripe"]["object"] is None
    assert len(story["events"]) == 2 and rows_of(story, "billing.subscriptions")[0]["differs"] == []


def test_an_event_id_opens_the_event_and_an_unknown_id_is_not_in_the_ledger(kit, ledgerctl_cli):
    process(kit, HISTORY.events[:1])
    event = show(ledgerctl_cli, HISTORY.events[0]["id"])
    assert event["event"]["id"] == HISTORY.events[0]["id"]
    result = ledgerctl_cli("objects", "show", "cus_nobodyhere", code=1)
    assert "cus_nobodyhere is not in the ledger" in result.stderr


@pytest.mark.parametrize("hostile", ["cus_" + "a" * 10_000, "cus_a\x00b", "not an id", "../../etc", "CUS_upper",
                                     "cus_", "_cus", "cus_ab%27;--", "cus_\udcff"])
def test_a_hostile_id_is_refused_with_a_message(kit, ledgerctl_cli, hostile):
    result = ledgerctl_cli("objects", "show", hostile, code=2)
    assert result.stderr.strip() and "Traceback" not in result.output


# -- the console's object page -------------------------------------------------------------------

from tests.support.console import app, client_for, console_settings  # noqa: E402,F401


def test_the_console_finds_an_object_by_its_id_and_marks_what_differs(kit, app, fake_stripe, monkeypatch):  # noqa: F811
    process(kit, HISTORY.events[:9])
    kit.execute("UPDATE billing.subscriptions SET status = 'past_due' WHERE id = %s", (HISTORY.subscription_id,))
    client = client_for(app, "vera")  # a viewer reads it

    found = client.get(f"/objects?id={HISTORY.subscription_id}")
    assert found.status_code == 302 and found.headers["Location"].endswith(f"/objects/{HISTORY.subscription_id}")
    assert client.get(f"/objects?id={HISTORY.events[0]['id']}").headers["Location"].endswith(
        f"/events/{HISTORY.events[0]['id']}")

    page = client.get(f"/objects/{HISTORY.subscription_id}").text
    assert "differs in status" in page and HISTORY.customer_id in page and 'id="fetch-stripe"' in page
    assert 'data-side="stripe"' not in page  # fetched only on request

    app.config["LEDGER"] = dataclasses.replace(app.config["LEDGER"], stripe_api_key=fake_stripe.api_key,
                                               stripe_api_base=fake_stripe.base_url)
    failed = client.get(f"/objects/{HISTORY.subscription_id}?stripe=1").text  # Stripe has no such object yet
    assert 'id="stripe-error"' in failed and "404" in failed
    fake_stripe.put_object(latest_object(HISTORY.events[:9], HISTORY.subscription_id))
    fetched = client.get(f"/objects/{HISTORY.subscription_id}?stripe=1").text
    assert 'id="stripe-fetched"' in fetched and fetched.count('data-side="stripe"') >= 1

    missing = client.get("/objects/cus_nobodyhere")
    assert missing.status_code == 404 and "not in the ledger" in missing.text


def test_an_event_not_yet_processed_is_listed_with_its_status_and_left_out_of_the_rebuilt_rows(kit, ledgerctl_cli):
    process(kit, HISTORY.events[:9])
    kit.record_many(HISTORY.events[9:])  # the cancellation, received, not yet processed
    story = show(ledgerctl_cli, HISTORY.subscription_id)
    assert story["events"][-1]["status"] == "received"
    [sub] = rows_of(story, "billing.subscriptions")
    assert sub["differs"] == [] and sub["rebuilt"]["status"] == "active"
