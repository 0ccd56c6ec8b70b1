"""Every shared Stripe fixture event processes (its object mirrored) or ends terminal with its reason; basil-era
objects map periods and parents correctly."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from ledger.deliveries import IncomingEvent
from devkit.factories import BASIL_API, event
from tests.support.constants import FIXTURES_DIR, fixture_files
from workers.processor import Outcome

# Where a processed event's object must end up besides billing.objects.
TABLE_FOR = {"customer.subscription.": "subscriptions", "customer.": "customers", "invoice.": "invoices",
             "checkout.session.": "checkout_sessions"}
# Types with a typed handler (the rest only reach the generic mirror).
TYPED_PREFIXES = (*TABLE_FOR, "entitlements.")

FILES = fixture_files()
OBJECTS = FIXTURES_DIR / "objects"


def record_raw(kit, text: str) -> dict:
    """Record the file's bytes as the verified body, as the receiver would."""
    evt = json.loads(text)
    kit.store().record_delivery(IncomingEvent(
        id=evt["id"], type=evt["type"], created=evt["created"], livemode=evt["livemode"],
        api_version=evt.get("api_version"), account=evt.get("account"), payload=text))
    return evt


def ts(value: int) -> datetime:
    return datetime.fromtimestamp(value, tz=timezone.utc)


@pytest.mark.skipif(not FILES, reason=f"no fixture events in {FIXTURES_DIR}")
@pytest.mark.parametrize("path", FILES or [None], ids=[p.name for p in FILES] or ["none"])
def test_a_fixture_event_ends_processed_and_mirrored_or_terminal_with_its_reason(kit, path: Path):
    evt = record_raw(kit, path.read_text())
    outcome = kit.processor(modules=()).process(evt["id"])
    row = kit.event(evt["id"])
    assert row["attempts"] == 1
    obj = evt["data"]["object"]
    typed = evt["type"].startswith(TYPED_PREFIXES) and evt["type"] != "invoice.upcoming"
    if not typed and not isinstance(obj.get("id"), str):
        # An upcoming invoice has no id: nothing can key it, and no handler takes the type.
        assert outcome is Outcome.FAILED_PERMANENT
        assert (row["status"], row["failure_reason"]) == ("failed_permanent", "object_without_id")
        assert set(kit.billing_counts().values()) == {0}
        return
    assert outcome is Outcome.PROCESSED, f"{row['status']} {row['failure_reason']}: {row['last_error']}"
    assert row["status"] == "processed"

    mirrored = kit.query("SELECT * FROM billing.objects")
    if isinstance(obj.get("id"), str):
        [mirror] = mirrored
        assert (mirror["id"], mirror["object_type"], mirror["data"]) == (obj["id"], obj["object"], obj)
        assert (mirror["source_event_id"], mirror["source_event_created"]) == (evt["id"], ts(evt["created"]))
        assert (mirror["livemode"], mirror["account"]) == (evt["livemode"], evt.get("account"))
        assert mirror["deleted"] is (evt["type"].endswith(".deleted")
                                     and evt["type"] != "customer.subscription.deleted")
    else:
        assert mirrored == []  # an entitlement summary has no id: its typed handler keeps it
    if not typed:
        assert {t: n for t, n in kit.billing_counts().items() if n} == {"objects": 1}
        return

    table = next((t for prefix, t in TABLE_FOR.items() if evt["type"].startswith(prefix)), None)
    if table:
        [written] = kit.query(f"SELECT * FROM billing.{table} WHERE id = %s", (obj["id"],))
        assert written["source_event_id"] == evt["id"]
        assert written["livemode"] is evt["livemode"]
    if evt["type"].startswith("customer.subscription."):
        [transition] = kit.query("SELECT * FROM billing.subscription_transitions WHERE event_id = %s", (evt["id"],))
        assert (transition["to_status"], transition["applied"]) == (obj["status"], True)
    if evt["type"] == "customer.deleted":
        assert kit.query("SELECT deleted FROM billing.customers")[0]["deleted"] is True
    if evt["type"].startswith("entitlements."):
        customer = obj["customer"] if isinstance(obj["customer"], str) else obj["customer"]["id"]
        keys = sorted({e.get("lookup_key") or (e["feature"] if isinstance(e["feature"], str) else e["feature"]["id"])
                       for e in obj["entitlements"]["data"]})
        assert [r["feature"] for r in kit.query(
            "SELECT feature FROM billing.entitlements WHERE customer_id = %s AND source = 'stripe' ORDER BY 1",
            (customer,))] == keys


def load_object(name: str) -> dict:
    path = OBJECTS / f"{name}__openapi.json"
    if not path.exists():
        pytest.skip(f"{path} is not there")
    return json.loads(path.read_text())


def process_basil(kit, event_type: str, obj: dict) -> dict:
    evt = event(event_type, obj, created=1_760_000_000, api_version=BASIL_API)
    assert kit.processor(modules=()).process(kit.record(evt)) is Outcome.PROCESSED, kit.event(evt["id"])
    return evt


def test_a_basil_subscription_takes_its_period_from_its_items(kit):
    sub = load_object("subscription")
    assert "current_period_start" not in sub
    item = sub["items"]["data"][0]
    evt = process_basil(kit, "customer.subscription.updated", sub)
    [row] = kit.query("SELECT * FROM billing.subscriptions")
    assert row["id"] == sub["id"] and row["customer_id"] == sub["customer"] and row["status"] == sub["status"]
    assert row["current_period_start"] == ts(item["current_period_start"])
    assert row["current_period_end"] == ts(item["current_period_end"])
    assert row["price_id"] == item["price"]["id"] and row["product_id"] == item["price"]["product"]
    assert row["source_event_id"] == evt["id"]
    [transition] = kit.query("SELECT * FROM billing.subscription_transitions")
    assert transition["period_start"] == ts(item["current_period_start"])


def test_a_basil_invoice_takes_its_subscription_from_parent_subscription_details(kit):
    inv = load_object("invoice")
    evt = process_basil(kit, "invoice.finalized", inv)
    [row] = kit.query("SELECT * FROM billing.invoices")
    assert row["id"] == inv["id"] and row["customer_id"] == inv["customer"]
    assert row["subscription_id"] == inv["parent"]["subscription_details"]["subscription"]
    assert row["amount_due"] == inv["amount_due"] and row["status"] == inv["status"]
    assert row["source_event_id"] == evt["id"]


def test_a_basil_customer_processes(kit):
    cus = load_object("customer")
    process_basil(kit, "customer.updated", cus)
    [row] = kit.query("SELECT id, email, deleted FROM billing.customers")
    assert row == {"id": cus["id"], "email": cus["email"], "deleted": False}


def test_a_basil_checkout_session_processes(kit):
    session = load_object("checkout.session")
    process_basil(kit, "checkout.session.completed", session)
    [row] = kit.query("SELECT id, mode, status, payment_status, customer_id FROM billing.checkout_sessions")
    assert row == {"id": session["id"], "mode": session["mode"], "status": session["status"],
                   "payment_status": session["payment_status"], "customer_id": session["customer"]}


def test_a_basil_entitlement_summary_processes(kit):
    summary = load_object("entitlements.active_entitlement_summary")
    process_basil(kit, "entitlements.active_entitlement_summary.updated", summary)
    keys = sorted({e["lookup_key"] for e in summary["entitlements"]["data"]})
    assert kit.query("SELECT customer_id, feature, source FROM billing.entitlements ORDER BY feature") == [
        {"customer_id": summary["customer"], "feature": k, "source": "stripe"} for k in keys]
