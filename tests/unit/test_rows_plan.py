"""What a batch of row changes comes to (workers/rows.py ``plan``), without a database: the in-memory
writer applies each plan to dicts. The same plan is what the live and the rebuild writers write
(tests/integration/test_writers_differential.py compares all three on Postgres)."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from workers.billing.tables import (CUSTOMERS, ENTITLEMENTS, SUBSCRIPTION_ENTITLEMENTS, SUBSCRIPTIONS,
                                    TRANSITIONS)
from workers.rows import RowOfAnotherOwner, RowShapeError, Stored, needs, plan
from workers.writers import MemoryWriter


def at(second: int) -> datetime:
    return datetime.fromtimestamp(1_760_000_000 + second, tz=timezone.utc)


def subscription(status: str, features=("seats",)) -> dict:
    return {"id": "sub_1", "customer_id": "cus_1", "status": status, "price_id": None, "product_id": None,
            "quantity": 1, "cancel_at_period_end": False, "current_period_start": None, "current_period_end": None,
            "trial_end": None, "canceled_at": None, "ended_at": None, "features": list(features)}


def record(writer: MemoryWriter, event_id: str, second: int, status: str, **kw) -> None:
    rows = writer.rows_for(event_id=event_id, created=at(second), account=kw.get("account"), livemode=False)
    rows.upsert(SUBSCRIPTIONS, subscription(status))
    rows.append(TRANSITIONS, {"event_id": event_id, "event_type": "customer.subscription.updated",
                              "subscription_id": "sub_1", "to_status": status, "period_start": None,
                              "period_end": None, "event_created": at(second), "account": kw.get("account")})
    rows.derive(SUBSCRIPTION_ENTITLEMENTS, "cus_1")


def test_a_batch_keeps_the_newest_change_of_a_row_whatever_order_its_events_came_in():
    writer = MemoryWriter()
    record(writer, "evt_c", 3, "canceled")
    record(writer, "evt_a", 1, "trialing")
    record(writer, "evt_b", 2, "active")
    writer.flush()
    [row] = writer.tables()["billing.subscriptions"]
    assert (row["status"], row["source_event_id"]) == ("canceled", "evt_c")


def test_transitions_chain_from_the_stored_row_through_the_batchs_events_in_stripes_order():
    writer = MemoryWriter()
    record(writer, "evt_a", 1, "trialing")
    writer.flush()
    record(writer, "evt_c", 3, "past_due")
    record(writer, "evt_0", 0, "incomplete")  # older than the stored row: recorded, not applied
    record(writer, "evt_b", 2, "active")
    writer.flush()
    chain = {r["event_id"]: (r["from_status"], r["to_status"], r["applied"])
             for r in writer.tables()["billing.subscription_transitions"]}
    assert chain == {"evt_a": (None, "trialing", True), "evt_0": ("trialing", "incomplete", False),
                     "evt_b": ("trialing", "active", True), "evt_c": ("active", "past_due", True)}


def test_a_same_second_tie_is_broken_by_the_event_id_the_same_way_every_time():
    for order in (("evt_x", "evt_y"), ("evt_y", "evt_x")):
        writer = MemoryWriter()
        for event_id in order:
            record(writer, event_id, 5, "active" if event_id == "evt_x" else "past_due")
        writer.flush()
        assert writer.tables()["billing.subscriptions"][0]["source_event_id"] == "evt_y"


def test_a_derived_set_is_written_again_so_a_drifted_one_heals_and_a_watched_one_only_when_it_changes():
    writer = MemoryWriter()
    record(writer, "evt_a", 1, "trialing")
    writer.flush()
    assert [r["feature"] for r in writer.tables()["billing.entitlements"]] == ["seats"]
    writer.sets[ENTITLEMENTS].clear()  # drifted from its source rows
    record(writer, "evt_b", 2, "active")  # trialing and active both grant: the same set, written again
    writer.flush()
    assert [r["feature"] for r in writer.tables()["billing.entitlements"]] == ["seats"]

    # An on_change of the customer reads the stored set anyway: an unchanged set is then not written.
    record(writer, "evt_c", 3, "active")
    writer.rows_for(event_id="evt_c", created=at(3), account=None, livemode=False).on_change(
        ENTITLEMENTS, "cus_1", lambda before, after: None)
    items = writer.changes.items[:]
    assert ENTITLEMENTS not in plan(items, writer.read(needs(items))).sets
    writer.flush()
    record(writer, "evt_d", 4, "canceled")
    writer.flush()
    assert writer.tables().get("billing.entitlements", []) == []


def test_a_row_that_does_not_match_its_tables_declaration_is_refused():
    rows = MemoryWriter().rows_for(event_id="evt_a", created=at(1), account=None, livemode=False)
    with pytest.raises(RowShapeError, match="missing email"):
        rows.upsert(CUSTOMERS, {"id": "cus_1", "name": None, "deleted": False, "metadata": {}})


def test_a_second_owner_of_a_key_in_one_batch_is_refused_at_its_upsert():
    writer = MemoryWriter()
    record(writer, "evt_a", 1, "active", account="acct_1")
    with pytest.raises(RowOfAnotherOwner, match="constraint=billing_row_owner"):
        record(writer, "evt_b", 2, "active", account="acct_2")


def test_nothing_stored_plans_nothing_to_read_for_an_upsert_alone():
    writer = MemoryWriter()
    writer.rows_for(event_id="evt_a", created=at(1), account=None, livemode=False).upsert(
        CUSTOMERS, {"id": "cus_1", "email": None, "name": None, "deleted": False, "metadata": {}})
    assert not needs(writer.changes.items)
    assert plan(writer.changes.items, Stored()).latest[CUSTOMERS][0]["id"] == "cus_1"
