"""ledgerctl reconcile in-process against the fake Stripe API and a real Postgres: no drift after a backfill,
each kind of drift planted on purpose found and named (exit 1), --fix repairing it through the backfill path,
what it cannot fix reported, accounts kept apart. After a catch-up with real workers:
tests/e2e/test_catchup_e2e.py."""
from __future__ import annotations

import json
import time

from tests.support.stripe_api import env_of, fake_stripe  # noqa: F401

NOW = int(time.time())
TYPES = ("customers", "subscriptions", "invoices", "charges")


def stripe_state(fake, account=None) -> None:
    objects = [
        {"id": "cus_1", "object": "customer", "email": "one@example.test", "name": "One", "created": NOW - 900},
        {"id": "cus_2", "object": "customer", "email": "two@example.test", "name": "Two", "created": NOW - 800},
        {"id": "sub_1", "object": "subscription", "customer": "cus_1", "status": "active", "created": NOW - 700,
         "current_period_start": NOW - 700, "current_period_end": NOW - 700 + 30 * 86400, "quantity": 1,
         "cancel_at_period_end": False, "items": {"object": "list", "data": [
             {"id": "si_1", "object": "subscription_item", "price": {"id": "price_1", "product": "prod_1"}}]}},
        {"id": "sub_2", "object": "subscription", "customer": "cus_2", "status": "canceled", "created": NOW - 600,
         "current_period_start": NOW - 600, "current_period_end": NOW - 600 + 30 * 86400, "quantity": 1,
         "cancel_at_period_end": False, "items": {"object": "list", "data": []}},
        {"id": "in_1", "object": "invoice", "customer": "cus_1", "subscription": "sub_1", "status": "paid",
         "amount_due": 1500, "amount_paid": 1500, "currency": "usd", "created": NOW - 500,
         "period_start": NOW - 700, "period_end": NOW - 700 + 30 * 86400},
        {"id": "ch_1", "object": "charge", "status": "succeeded", "amount": 1500, "amount_refunded": 0,
         "currency": "usd", "created": NOW - 400},
    ]
    for obj in objects:
        fake.put_object({**obj, "livemode": False}, account=account)


def reconcile(ledgerctl_cli, fake, *args, code):
    result = ledgerctl_cli("reconcile", *TYPES, "--json", *args, code=code, env=env_of(fake))
    return json.loads(result.stdout)


def drift(report) -> set[tuple]:
    return {(d["type"], d["id"], d["kind"], d["field"]) for d in report["drift"]}


def age_local_rows(kit) -> None:
    """As if events a minute old wrote the local rows (a fetch of this second is newer)."""
    for table in ("customers", "subscriptions", "invoices", "objects"):
        kit.execute(f"UPDATE billing.{table} SET source_event_created = source_event_created - interval '1 minute'")


def test_no_drift_after_a_backfill(kit, fake_stripe, ledgerctl_cli):
    stripe_state(fake_stripe)
    ledgerctl_cli("backfill", *TYPES, env=env_of(fake_stripe))
    report = reconcile(ledgerctl_cli, fake_stripe, code=0)
    assert report["drift"] == []
    assert report["checked"] == {"customers": {"local": 2, "stripe": 2}, "subscriptions": {"local": 2, "stripe": 2},
                                 "invoices": {"local": 1, "stripe": 1}, "charges": {"local": 1, "stripe": 1}}
    table = ledgerctl_cli("reconcile", env=env_of(fake_stripe), code=0)
    assert table.stdout.strip().endswith("no drift")


def test_each_planted_drift_is_found_and_named_and_fix_repairs_it(kit, fake_stripe, ledgerctl_cli):
    stripe_state(fake_stripe)
    fake_stripe.put_object({"id": "cus_gone", "object": "customer", "created": NOW - 300, "livemode": False})
    ledgerctl_cli("backfill", *TYPES, env=env_of(fake_stripe))
    age_local_rows(kit)

    fake_stripe.put_object({"id": "cus_3", "object": "customer", "email": "three@example.test", "created": NOW,
                            "livemode": False})                                                # missing locally
    fake_stripe.delete_object("cus_gone")                                                    # missing at Stripe
    kit.execute("UPDATE billing.subscriptions SET status = 'active' WHERE id = 'sub_2'")     # stale status
    kit.execute("UPDATE billing.subscriptions SET current_period_end = current_period_end + interval '1 day' "
                "WHERE id = 'sub_1'")                                                        # wrong period
    kit.execute("UPDATE billing.invoices SET amount_paid = 0 WHERE id = 'in_1'")             # wrong amount
    kit.execute("UPDATE billing.customers SET email = 'stale@example.test' WHERE id = 'cus_2'")
    kit.execute("UPDATE billing.objects SET data = jsonb_set(data, '{amount}', '999') WHERE id = 'ch_1'")

    report = reconcile(ledgerctl_cli, fake_stripe, code=1)
    assert drift(report) == {
        ("customers", "cus_3", "missing_locally", None),
        ("customers", "cus_gone", "missing_at_stripe", None),
        ("customers", "cus_2", "stale_field", "email"),
        ("subscriptions", "sub_2", "stale_status", "status"),
        ("subscriptions", "sub_1", "wrong_period", "current_period_end"),
        ("invoices", "in_1", "wrong_amount", "amount_paid"),
        ("charges", "ch_1", "wrong_amount", "amount"),
    }
    by_key = {(d["id"], d["field"]): d for d in report["drift"]}
    assert (by_key[("sub_2", "status")]["local"], by_key[("sub_2", "status")]["stripe"]) == ("active", "canceled")
    assert (by_key[("in_1", "amount_paid")]["local"], by_key[("in_1", "amount_paid")]["stripe"]) == (0, 1500)

    fixed = reconcile(ledgerctl_cli, fake_stripe, "--fix", code=0)
    assert {(f["type"], f["id"]) for f in fixed["fixes"] if f["fixed"]} == {
        ("customers", "cus_3"), ("customers", "cus_gone"), ("customers", "cus_2"), ("subscriptions", "sub_2"),
        ("subscriptions", "sub_1"), ("invoices", "in_1"), ("charges", "ch_1")}
    assert fixed["unfixed"] == 0
    assert kit.query("SELECT deleted FROM billing.customers WHERE id = 'cus_gone'") == [{"deleted": True}]

    assert reconcile(ledgerctl_cli, fake_stripe, code=0)["drift"] == []


def test_a_row_stripe_does_not_know_cannot_be_fixed_and_keeps_the_exit_status_1(kit, fake_stripe, ledgerctl_cli):
    stripe_state(fake_stripe)
    ledgerctl_cli("backfill", *TYPES, env=env_of(fake_stripe))
    kit.execute("INSERT INTO billing.customers (id, livemode, source_event_id, source_event_created) "
                "VALUES ('cus_unknown', false, 'evt_x', now() - interval '1 hour')")
    report = reconcile(ledgerctl_cli, fake_stripe, "--fix", code=1)
    assert [(f["id"], f["fixed"]) for f in report["fixes"]] == [("cus_unknown", False)]
    assert "gone at Stripe" in report["fixes"][0]["note"]
    assert kit.query("SELECT deleted FROM billing.customers WHERE id = 'cus_unknown'") == [{"deleted": False}]


def test_accounts_are_reconciled_apart(kit, fake_stripe, ledgerctl_cli):
    stripe_state(fake_stripe, account="acct_1conn")
    ledgerctl_cli("backfill", *TYPES, "--account", "acct_1conn", env=env_of(fake_stripe))
    # The platform has none of these objects, and none of the connected account's rows are the platform's.
    assert reconcile(ledgerctl_cli, fake_stripe, code=0)["checked"]["customers"] == {"local": 0, "stripe": 0}
    connected = reconcile(ledgerctl_cli, fake_stripe, "--account", "acct_1conn", code=0)
    assert connected["drift"] == [] and connected["checked"]["customers"] == {"local": 2, "stripe": 2}
