"""Backfill in-process against the fake Stripe API and a real Postgres: canceled subscriptions included,
the order guard between a fetched snapshot and events (either arriving first), no transaction open while
a page is fetched, dry runs, connected accounts, the generic mirror, ledgerctl's usage errors.
A backfill racing live events with real processes: tests/e2e/test_catchup_e2e.py."""
from __future__ import annotations

import json
import time

import pytest

from devkit.factories import SubscriptionHistory, event
from tests.support.stripe_api import API_KEY, TimedFake, api_settings, env_of, fake_stripe  # noqa: F401
from tests.support.workers import RecordingWaker
from workers.backfill import Backfill, collections_named
from workers.stripe_api import RetryRule, StripeApi

NOW = int(time.time())


def subscription(sub_id: str, status: str, *, customer: str = "cus_1", created: int = NOW - 86400,
                 period_start: int = NOW - 86400) -> dict:
    return {"id": sub_id, "object": "subscription", "customer": customer, "status": status, "created": created,
            "livemode": False, "cancel_at_period_end": False, "current_period_start": period_start,
            "current_period_end": period_start + 30 * 86400, "quantity": 1,
            "items": {"object": "list", "data": [{"id": f"si_{sub_id}", "object": "subscription_item",
                                                  "price": {"id": "price_1", "object": "price",
                                                            "product": "prod_1"}, "quantity": 1}]}}


def backfill(kit, settings, fake) -> Backfill:
    settings = api_settings(settings, fake)
    return Backfill(kit.pool("backfill"), StripeApi(settings, rule=RetryRule(base_s=0.01)))


def sub_row(kit, sub_id: str) -> dict:
    return kit.query("SELECT status, source_event_id, source_event_created, account FROM billing.subscriptions "
                     "WHERE id = %s", (sub_id,))[0]


def test_subscriptions_are_listed_with_status_all_so_canceled_ones_are_backfilled_too(kit, settings, fake_stripe):
    fake_stripe.put_object(subscription("sub_active", "active"))
    fake_stripe.put_object(subscription("sub_canceled", "canceled"))
    [result] = backfill(kit, settings, fake_stripe).run(collections_named(["subscriptions"]))
    assert (result.fetched, result.applied, result.kept) == (2, 2, 0)
    assert {r["id"]: r["status"] for r in kit.query("SELECT id, status FROM billing.subscriptions")} == {
        "sub_active": "active", "sub_canceled": "canceled"}
    assert [r.query.get("status") for r in fake_stripe.requests if r.path == "/v1/subscriptions"] == ["all"]
    row = sub_row(kit, "sub_active")
    assert row["source_event_id"] == "api_fetch" and row["account"] is None
    # Snapshots are not events: no transition is recorded.
    assert kit.query("SELECT count(*) AS n FROM billing.subscription_transitions")[0]["n"] == 0


def test_a_snapshot_never_overwrites_a_newer_events_state_nor_an_older_event_the_snapshot(
        kit, settings, fake_stripe):
    history = SubscriptionHistory(start=NOW - 3600).lifecycle()
    processor = kit.processor(waker=RecordingWaker())
    sub_id = history.subscription_id
    # The newest event (customer.subscription.deleted) is created an hour in the future: newer than any
    # fetch of this test (the clock is read here, not at import: a long session would overtake it).
    newest = {**history.events[-1], "created": int(time.time()) + 3600}
    fake_stripe.put_object({**history.events[2]["data"]["object"], "created": NOW - 3600})  # an older state: active
    kit.record(newest)
    processor.process(newest["id"])
    assert sub_row(kit, sub_id)["status"] == "canceled"

    run = backfill(kit, settings, fake_stripe)
    [result] = run.run(collections_named(["subscriptions"]))
    row = sub_row(kit, sub_id)
    assert result.fetched == 1 and (row["status"], row["source_event_id"]) == ("canceled", newest["id"])

    # The other way round: a snapshot applied first, then an event older than its fetch arrives.
    kit.wipe()
    fake_stripe.put_object({**history.events[-1]["data"]["object"], "created": NOW - 3600})  # canceled, now
    [result] = run.run(collections_named(["subscriptions"]))
    assert result.applied == 1 and sub_row(kit, sub_id)["status"] == "canceled"
    older = history.events[2]  # customer.subscription.updated -> active, created an hour ago
    kit.record(older)
    processor.process(older["id"])
    assert kit.status(older["id"]) == "processed"
    row = sub_row(kit, sub_id)
    assert (row["status"], row["source_event_id"]) == ("canceled", "api_fetch")


class CheckingFake(TimedFake):
    """Before answering a page after the first, looks at what the backfill's connections are doing
    (``kit`` and ``seen`` are set by the test)."""

    kit = None
    seen: list[dict]

    def _answer(self, path, params, account):
        if params.get("starting_after"):
            self.seen.extend(self.kit.query(
                "SELECT state, xact_start FROM pg_stat_activity WHERE application_name = 'backfill'"))
        return super()._answer(path, params, account)


def test_no_transaction_is_open_while_the_next_page_is_fetched(kit, settings):
    with CheckingFake.serving(API_KEY) as fake:
        fake.kit = kit
        fake.seen = []
        for n in range(250):
            fake.put_object({"id": f"cus_{n:03d}", "object": "customer", "created": NOW - n, "livemode": False})
        [result] = backfill(kit, settings, fake).run(collections_named(["customers"]))
    assert result.fetched == 250 and result.applied == 250
    assert fake.seen and all(s["state"] == "idle" and s["xact_start"] is None for s in fake.seen), fake.seen


def test_a_dry_run_fetches_and_counts_and_writes_nothing(kit, settings, fake_stripe, ledgerctl_cli):
    fake_stripe.put_object({"id": "cus_1", "object": "customer", "created": NOW, "livemode": False})
    fake_stripe.put_object({"id": "ch_1", "object": "charge", "created": NOW, "amount": 100, "livemode": False})
    result = ledgerctl_cli("backfill", "customers", "charges", "--dry-run", "--json", env=env_of(fake_stripe))
    assert [(t["type"], t["fetched"]) for t in json.loads(result.stdout)["types"]] == [("customers", 1),
                                                                                   ("charges", 1)]
    assert kit.billing_counts()["customers"] == 0
    assert kit.query("SELECT count(*) AS n FROM billing.objects")[0]["n"] == 0


def test_every_type_without_a_table_of_its_own_is_kept_in_the_mirror(kit, settings, fake_stripe, ledgerctl_cli):
    fake_stripe.put_object({"id": "ch_1", "object": "charge", "created": NOW, "amount": 100, "livemode": False,
                            "status": "succeeded"})
    fake_stripe.put_object({"id": "prod_1", "object": "product", "created": NOW, "active": True, "livemode": False})
    fake_stripe.put_object({"id": "cs_1", "object": "checkout.session", "created": NOW, "status": "complete",
                            "customer": "cus_1", "livemode": False})
    result = ledgerctl_cli("backfill", "all", "--json", env=env_of(fake_stripe))
    applied = {t["type"]: t["applied"] for t in json.loads(result.stdout)["types"]}
    assert applied["charges"] == applied["products"] == applied["checkout_sessions"] == 1
    rows = kit.query("SELECT id, object_type, data->>'status' AS status, source_event_id FROM billing.objects "
                     "ORDER BY id")
    assert [(r["id"], r["object_type"]) for r in rows] == [("ch_1", "charge"), ("cs_1", "checkout.session"),
                                                          ("prod_1", "product")]
    assert {r["source_event_id"] for r in rows} == {"api_fetch"}


def test_a_connected_accounts_objects_are_written_as_its_own(kit, settings, fake_stripe, ledgerctl_cli):
    fake_stripe.put_object(subscription("sub_platform", "active"))
    fake_stripe.put_object(subscription("sub_connected", "past_due", customer="cus_c"), account="acct_1conn")
    ledgerctl_cli("backfill", "subscriptions", "--account", "acct_1conn", env=env_of(fake_stripe))
    assert kit.query("SELECT id, account FROM billing.subscriptions") == [{"id": "sub_connected",
                                                                          "account": "acct_1conn"}]


def test_created_since_narrows_the_listing(kit, settings, fake_stripe, ledgerctl_cli):
    fake_stripe.put_object({"id": "cus_old", "object": "customer", "created": NOW - 10 * 86400, "livemode": False})
    fake_stripe.put_object({"id": "cus_new", "object": "customer", "created": NOW - 3600, "livemode": False})
    ledgerctl_cli("backfill", "customers", "--created-since", "2d", env=env_of(fake_stripe))
    assert [r["id"] for r in kit.query("SELECT id FROM billing.customers")] == ["cus_new"]


@pytest.mark.parametrize("args, message", [(("backfill", "widgets"), "unknown object type 'widgets'"),
                                           (("backfill", "customers", "--account", "cus_1"), "connected account"),
                                           (("backfill",), "Missing argument")])
def test_bad_usage_exits_2(ledgerctl_cli, fake_stripe, args, message):
    result = ledgerctl_cli(*args, code=2, env=env_of(fake_stripe))
    assert message in result.output


def test_without_an_api_key_backfill_is_a_configuration_error_naming_the_variable(ledgerctl_cli):
    # In-process the ConfigError itself comes out (main() turns it into "error: ..." and exit status 2).
    with pytest.raises(AssertionError, match="ConfigError.*STRIPE_API_KEY is not set"):
        ledgerctl_cli("backfill", "customers")


def test_an_object_whose_row_belongs_to_another_account_is_refused_and_the_rest_applied(
        kit, settings, fake_stripe, ledgerctl_cli):
    fake_stripe.put_object(subscription("sub_platform", "active"))
    ledgerctl_cli("backfill", "subscriptions", env=env_of(fake_stripe))
    # The same id listed under a connected account (it cannot be at Stripe; a row never changes owner).
    fake_stripe.put_object(subscription("sub_platform", "canceled"), account="acct_1conn")
    fake_stripe.put_object(subscription("sub_connected", "active"), account="acct_1conn")
    result = ledgerctl_cli("backfill", "subscriptions", "--account", "acct_1conn", "--json", env=env_of(fake_stripe))
    [counts] = json.loads(result.stdout)["types"]
    assert (counts["fetched"], counts["applied"], counts["refused"]) == (2, 1, 1)
    assert {r["id"]: (r["status"], r["account"]) for r in kit.query(
        "SELECT id, status, account FROM billing.subscriptions")} == {
        "sub_platform": ("active", None), "sub_connected": ("active", "acct_1conn")}
