"""Safety across API versions, on real Postgres: the same lifecycle at every shape we read gives the same rows;
an event lacking a field its handlers require ends failed_permanent / unmappable_payload naming it, writing
nothing; ``ledgerctl replay`` re-applies it after an upgrade; ``ledgerctl handlers`` lists what each requires.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from devkit.factories import BASIL_API, CLOVER_API, DAHLIA_API, OLD_API, SubscriptionHistory, event, new_id
from ledger.config import Settings
from ledger.attempts import WorkerLedger
from tests.support.handlers_for_tests import register_pre_accounts_v2
from tests.support.workers import TEST_HANDLERS, RecordingWaker
from workers.processor import EventProcessor, Outcome
from workers.registry import load_handlers

TYPED_TABLES = ("customers", "subscriptions", "invoices", "checkout_sessions", "entitlements",
                "subscription_transitions")
# When a row was written, not what it says.
WRITTEN_AT = ("updated_at", "granted_at", "recorded_at")
ACCOUNT = "acct_1AccountsV2Customer0"


def fixed_ids() -> dict[str, str]:
    return {"customer_id": new_id("cus"), "subscription_id": new_id("sub"), "price_id": new_id("price"),
            "product_id": new_id("prod")}


def process_all(kit, events, processor=None) -> list[str]:
    processor = processor or kit.processor(waker=RecordingWaker(), modules=())
    ids = kit.record_many(events)
    for evt_id in ids:
        row = kit.event(evt_id) if processor.process(evt_id) is not Outcome.PROCESSED else None
        assert row is None, f"{evt_id}: {row['status']} {row['failure_reason']}: {row['last_error']}"
    return ids


def typed_rows(kit, events) -> dict[str, list[str]]:
    """Every typed billing row, with the ids that differ from one history to the next (events, invoices)
    replaced by their place in the history, so histories of the same lifecycle compare equal."""
    labels = {}
    for n, evt in enumerate(events):
        labels[evt["id"]] = f"<event {n}>"
        obj = evt["data"]["object"]
        if obj.get("object") == "invoice":
            labels.setdefault(obj["id"], f"<invoice of event {n}>")
    rows = {}
    for table in TYPED_TABLES:
        found = kit.query(f"SELECT to_jsonb(t) - %s::text[] AS r FROM billing.{table} t", (list(WRITTEN_AT),))
        texts = [json.dumps(r["r"], sort_keys=True) for r in found]
        for raw, label in labels.items():
            texts = [t.replace(json.dumps(raw), json.dumps(label)) for t in texts]
        rows[table] = sorted(texts)
    return rows


def lifecycle_at(api_version: str, **ids) -> SubscriptionHistory:
    return SubscriptionHistory(api_version=api_version, **ids).lifecycle()


# --- (a) one lifecycle, every shape ----------------------------------------------------------------

def test_the_same_lifecycle_at_every_api_version_we_read_gives_the_same_billing_rows(kit):
    ids = fixed_ids()
    rows = {}
    for api_version in (OLD_API, BASIL_API, CLOVER_API, DAHLIA_API):
        kit.wipe()
        history = lifecycle_at(api_version, **ids)
        process_all(kit, history.events)
        rows[api_version] = typed_rows(kit, history.events)
    assert rows[OLD_API]["subscriptions"] and rows[OLD_API]["entitlements"] == []  # canceled at the end
    assert len(rows[OLD_API]["invoices"]) == 2 and len(rows[OLD_API]["subscription_transitions"]) == 6
    for api_version in (BASIL_API, CLOVER_API, DAHLIA_API):
        assert rows[api_version] == rows[OLD_API], api_version


def test_an_accounts_v2_customers_lifecycle_at_clover_is_keyed_by_its_customer_account(kit):
    ids = fixed_ids()
    history = SubscriptionHistory(api_version=CLOVER_API, customer_account=ACCOUNT, **ids).lifecycle()
    # No customer.created for an Accounts v2 customer: it is an account, not a Customer object.
    events = [e for e in history.events if e["type"] != "customer.created"]
    subscription = events[0]["data"]["object"]
    assert (subscription["customer"], subscription["customer_account"]) == (None, ACCOUNT)
    session = event("checkout.session.completed",
                    {"id": new_id("cs"), "object": "checkout.session", "customer": None, "customer_account": ACCOUNT,
                     "subscription": ids["subscription_id"], "mode": "subscription", "status": "complete"},
                    created=history.start, api_version=CLOVER_API)
    process_all(kit, [*events[:2], session, *events[2:]])

    [sub] = kit.query("SELECT customer_id, status FROM billing.subscriptions")
    assert (sub["customer_id"], sub["status"]) == (ACCOUNT, "canceled")
    assert {r["customer_id"] for r in kit.query("SELECT customer_id FROM billing.invoices")} == {ACCOUNT}
    assert kit.query("SELECT customer_id FROM billing.checkout_sessions") == [{"customer_id": ACCOUNT}]
    # While it was active the account held the features (entitlements are keyed by the customer id).
    kit.wipe()
    process_all(kit, events[:2])
    assert {(r["customer_id"], r["feature"]) for r in kit.query("SELECT * FROM billing.entitlements")} == {
        (ACCOUNT, "reports"), (ACCOUNT, "seats")}


# --- (b) a newer shape that lacks a required field --------------------------------------------------

def without_customer(api_version: str) -> dict:
    evt = SubscriptionHistory(api_version=api_version).lifecycle().events[2]
    evt["data"]["object"].update(customer=None, customer_account=None)
    return evt


def summary_without_customer(api_version: str) -> dict:
    return event("entitlements.active_entitlement_summary.updated",
                 {"object": "entitlements.active_entitlement_summary", "customer": None,
                  "entitlements": {"object": "list", "data": [{"lookup_key": "seats"}]}},
                 created=1_700_000_000, api_version=api_version)


@pytest.mark.parametrize("build, field, handler_name", [
    (without_customer, "data.object.customer or data.object.customer_account", "SubscriptionHandler"),
    (summary_without_customer, "data.object.customer", "apply_entitlement_summary"),
], ids=["subscription", "entitlement_summary"])
def test_an_event_at_a_newer_version_lacking_a_required_field_fails_permanently_naming_it(
        kit, build, field, handler_name):
    processor = kit.processor(waker=RecordingWaker(), modules=())
    evt_id = kit.record(build(DAHLIA_API))

    assert processor.process(evt_id) is Outcome.FAILED_PERMANENT
    row = kit.event(evt_id)
    assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed_permanent", "unmappable_payload", 1)
    assert row["last_error"].startswith(f"{field} is missing")
    # Refused by the declared requirements, before any handler ran: the handler and the version are named.
    assert handler_name in row["last_error"] and DAHLIA_API in row["last_error"]
    assert "replay after an upgrade" in row["last_error"]
    [attempt] = kit.attempts(evt_id)
    assert (attempt["outcome"], attempt["error_class"]) == ("failed_permanent", "UnmappablePayload")
    assert set(kit.billing_counts().values()) == {0}, "a refused event wrote billing rows"
    assert processor.process(evt_id) is Outcome.NOT_CLAIMED  # terminal: never retried on its own


# --- (c) replay after an upgrade --------------------------------------------------------------------

def pre_upgrade_processor(kit, settings) -> EventProcessor:
    """The release before the upgrade: the built-in handlers plus a subscription requirement of
    data.object.customer (tests/support/handlers_for_tests.register_pre_accounts_v2)."""
    old = dataclasses.replace(settings, handler_modules=())
    registry = load_handlers(old)
    register_pre_accounts_v2(registry)
    return EventProcessor.from_settings(old, WorkerLedger(kit.pool("pre-upgrade", old)), registry, RecordingWaker())


def test_ledgerctl_replay_re_applies_an_event_the_release_before_an_upgrade_refused(kit, settings, ledgerctl_cli):
    ids = fixed_ids()
    history = SubscriptionHistory(api_version=CLOVER_API, customer_account=ACCOUNT, **ids).lifecycle()
    created, activated = history.events[1], history.events[2]
    before_upgrade = pre_upgrade_processor(kit, settings)
    evt_ids = kit.record_many([created, activated])
    for evt_id in evt_ids:
        assert before_upgrade.process(evt_id) is Outcome.FAILED_PERMANENT
        row = kit.event(evt_id)
        assert (row["failure_reason"], row["last_error"].split(" is missing")[0]) == (
            "unmappable_payload", "data.object.customer")
        assert "pre_accounts_v2_subscription" in row["last_error"] and CLOVER_API in row["last_error"]
    assert set(kit.billing_counts().values()) == {0}

    # The upgrade: the built-in handlers alone, which read customer_account. Then the operator's replay.
    result = ledgerctl_cli("replay", "--status", "failed_permanent", "--reason", "unmappable_payload", "--yes",
                           "--why", "upgraded: Accounts v2 customers", "--json")
    assert sorted(r["id"] for r in json.loads(result.stdout)["replayed"]) == sorted(evt_ids)
    upgraded = kit.processor(waker=RecordingWaker(), modules=())
    for evt_id in evt_ids:
        assert upgraded.process(evt_id) is Outcome.PROCESSED
        assert [a["outcome"] for a in kit.attempts(evt_id)] == ["failed_permanent", "processed"]

    [sub] = kit.query("SELECT id, customer_id, status FROM billing.subscriptions")
    assert (sub["id"], sub["customer_id"], sub["status"]) == (ids["subscription_id"], ACCOUNT, "active")
    assert [(t["from_status"], t["to_status"]) for t in kit.query(
        "SELECT from_status, to_status FROM billing.subscription_transitions ORDER BY event_created")] == [
        (None, "trialing"), ("trialing", "active")]
    assert {r["feature"] for r in kit.query("SELECT feature FROM billing.entitlements WHERE customer_id = %s",
                                            (ACCOUNT,))} == {"reports", "seats"}


# --- ledgerctl handlers ---------------------------------------------------------------------------

def test_ledgerctl_handlers_lists_every_pattern_its_handler_and_what_it_requires(ledgerctl_cli):
    listed = json.loads(ledgerctl_cli("handlers", "--json").stdout)
    by_pattern = {row["pattern"]: row for row in listed}
    assert by_pattern["customer.subscription.updated"] == {
        "pattern": "customer.subscription.updated", "handler": "workers.billing.handlers.SubscriptionHandler",
        "requires": ["data.object.id", ["data.object.customer", "data.object.customer_account"],
                     "data.object.status"]}
    assert by_pattern["*"] == {"pattern": "*", "handler": "workers.billing.handlers.ObjectMirror", "requires": []}
    # The configured module's handlers (LEDGER_HANDLER_MODULES), after the built-ins, in registration order.
    assert by_pattern["test.requires"]["handler"] == "tests.support.handlers_for_tests.requires_fields"
    assert [row["pattern"] for row in listed] == load_handlers(Settings(handler_modules=(TEST_HANDLERS,))).patterns()

    table = ledgerctl_cli("handlers").stdout.splitlines()
    assert table[0].split() == ["PATTERN", "HANDLER", "REQUIRES"]
    [subscription_line] = [line for line in table if line.startswith("customer.subscription.updated ")]
    assert subscription_line.split(None, 2)[2] == (
        "data.object.id, data.object.customer or data.object.customer_account, data.object.status")
    [mirror_line] = [line for line in table if line.startswith("* ")]
    assert mirror_line.split() == ["*", "workers.billing.handlers.ObjectMirror", "-"]


def test_ledgerctl_handlers_says_in_one_line_that_a_configured_module_cannot_be_imported(ledgerctl_cli):
    result = ledgerctl_cli("handlers", env={"LEDGER_HANDLER_MODULES": "no_such_module_here"}, code=2)
    assert result.stderr.strip() == "error: a handler module cannot be imported: No module named 'no_such_module_here'"
