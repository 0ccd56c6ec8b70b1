"""Objects fetched from the Stripe API (workers/billing/snapshots.py) against events, on real Postgres.

A snapshot's ordering key is (the second its answer arrived, 'api_fetch'): it wins over an event of an earlier
second, loses to an event of the same second or later, and in any order of events and snapshots the rows end at
the newest state."""
from __future__ import annotations

import json
from datetime import datetime, timezone

import psycopg
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from devkit.factories import SubscriptionHistory, event
from workers.billing.snapshots import API_FETCH, apply_object, ordering_key
from workers.processor import Outcome

T0 = 1_760_000_000


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def fetched(kit, obj: dict, fetched_at: float, *, account: str | None = None, livemode: bool = False,
            **options) -> bool:
    """Apply ``obj`` as fetched at ``fetched_at`` (epoch seconds), in a transaction of its own."""
    with kit.connect() as conn:
        with conn.transaction():
            return apply_object(conn, obj, fetched_at=at(fetched_at), account=account, livemode=livemode,
                                **options)


def process(kit, processor, evt: dict) -> None:
    assert processor.process(kit.record(evt)) is Outcome.PROCESSED, kit.event(evt["id"])


def customer(email: str, **extra) -> dict:
    return {"id": "cus_snap", "object": "customer", "email": email, "name": None, "metadata": {}, **extra}


def row(kit, table: str = "customers") -> dict:
    [found] = kit.query(f"SELECT * FROM billing.{table}")
    return found


def test_the_ordering_key_is_the_fetch_second_and_sorts_before_every_event_of_that_second():
    key = ordering_key(at(T0 + 0.75))
    assert key == (at(T0), API_FETCH)
    assert key < (at(T0), "evt_0") and key > (at(T0 - 1), "evt_zzzz")
    with pytest.raises(ValueError, match="timezone-aware"):
        ordering_key(datetime(2026, 1, 1))


def test_a_snapshot_fetched_after_an_event_wins_over_it(kit):
    processor = kit.processor(modules=())
    process(kit, processor, event("customer.updated", customer("event@example.test"), created=T0))

    assert fetched(kit, customer("fetched@example.test"), T0 + 1.2) is True
    written = row(kit)
    assert (written["email"], written["source_event_id"], written["source_event_created"]) == (
        "fetched@example.test", "api_fetch", at(T0 + 1))
    mirror = row(kit, "objects")
    assert (mirror["data"]["email"], mirror["source_event_id"], mirror["source_event_created"]) == (
        "fetched@example.test", "api_fetch", at(T0 + 1))


@pytest.mark.parametrize("event_second", [T0 + 5, T0 + 6], ids=["same second", "a later second"])
@pytest.mark.parametrize("snapshot_first", [True, False], ids=["snapshot applied first", "event applied first"])
def test_an_event_of_the_same_second_or_later_wins_over_the_snapshot(kit, event_second, snapshot_first):
    processor = kit.processor(modules=())
    evt = event("customer.updated", customer("event@example.test"), created=event_second)
    if snapshot_first:
        assert fetched(kit, customer("fetched@example.test"), T0 + 5.9) is True
        process(kit, processor, evt)
    else:
        process(kit, processor, evt)
        assert fetched(kit, customer("fetched@example.test"), T0 + 5.9) is False  # nothing written
    for table in ("customers", "objects"):
        assert row(kit, table)["source_event_id"] == evt["id"], table
    assert row(kit)["email"] == "event@example.test"


def test_an_older_event_delivered_after_the_snapshot_does_not_overwrite_it(kit):
    processor = kit.processor(modules=())
    history = SubscriptionHistory()
    sub = history._subscription("active", history.start)
    assert fetched(kit, sub, history.start + 100.5) is True
    before = {t: kit.query(f"SELECT * FROM billing.{t}") for t in ("subscriptions", "objects")}

    late = event("customer.subscription.updated", history._subscription("past_due", history.start),
                 created=history.start + 99)
    process(kit, processor, late)

    assert {t: kit.query(f"SELECT * FROM billing.{t}") for t in ("subscriptions", "objects")} == before
    [transition] = kit.query("SELECT event_id, applied FROM billing.subscription_transitions")
    assert transition == {"event_id": late["id"], "applied": False}  # the event's own history, not applied


def test_a_subscription_snapshot_derives_entitlements_and_records_no_transition(kit):
    history = SubscriptionHistory(features=("seats", "reports"))
    assert fetched(kit, history._subscription("active", history.start), history.start + 10) is True
    assert kit.query("SELECT feature, source FROM billing.entitlements ORDER BY feature") == [
        {"feature": "reports", "source": "subscription"}, {"feature": "seats", "source": "subscription"}]
    canceled = history._subscription("canceled", history.start, canceled_at=history.start + 20,
                                     ended_at=history.start + 20)
    assert fetched(kit, canceled, history.start + 30) is True
    assert kit.query("SELECT * FROM billing.entitlements") == []
    assert kit.query("SELECT * FROM billing.subscription_transitions") == []
    assert kit.query("SELECT count(*) AS n FROM ledger.outbox") == [{"n": 0}]


def test_a_subscription_snapshot_takes_the_entitlements_map_given_or_configured(kit, tmp_path, monkeypatch):
    history = SubscriptionHistory(features=("seats",))
    sub = history._subscription("active", history.start)
    assert fetched(kit, sub, history.start + 10, entitlements_map={history.price_id: ["sso"]})
    assert row(kit, "subscriptions")["features"] == ["seats", "sso"]

    path = tmp_path / "entitlements.json"
    path.write_text(json.dumps({history.product_id: ["audit"]}))
    monkeypatch.setenv("LEDGER_ENTITLEMENTS_MAP", str(path))
    assert fetched(kit, sub, history.start + 11)
    assert row(kit, "subscriptions")["features"] == ["audit", "seats"]
    assert [r["feature"] for r in kit.query("SELECT feature FROM billing.entitlements ORDER BY 1")] == [
        "audit", "seats"]


def test_a_deleted_object_is_marked_deleted_in_its_table_and_the_mirror(kit):
    processor = kit.processor(modules=())
    process(kit, processor, event("customer.updated", customer("event@example.test"), created=T0))

    # What retrieving a deleted customer answers.
    assert fetched(kit, {"id": "cus_snap", "object": "customer", "deleted": True}, T0 + 3) is True
    assert row(kit)["deleted"] is True
    mirror = row(kit, "objects")
    assert (mirror["deleted"], mirror["data"]) == (True, {"id": "cus_snap", "object": "customer", "deleted": True})

    invoice = {"id": "in_snap", "object": "invoice", "deleted": True}
    assert fetched(kit, invoice, T0 + 3) is True
    assert kit.query("SELECT deleted FROM billing.invoices") == [{"deleted": True}]


def test_an_object_without_a_typed_table_is_mirrored_only_with_its_account_and_mode(kit):
    charge = {"id": "ch_snap", "object": "charge", "amount": 500, "livemode": True}
    assert fetched(kit, charge, T0, account="acct_1Snap", livemode=True) is True
    assert kit.query("SELECT id, object_type, account, livemode, data FROM billing.objects") == [
        {"id": "ch_snap", "object_type": "charge", "account": "acct_1Snap", "livemode": True, "data": charge}]
    assert {t: n for t, n in kit.billing_counts().items() if n} == {"objects": 1}
    assert fetched(kit, charge, T0) is True  # the platform's view of the same id is a row of its own
    assert fetched(kit, charge, T0, account="acct_1Snap", livemode=True) is False  # same key: not newer


def test_a_checkout_session_snapshot_links_its_customer_as_the_event_does(kit):
    session = {"id": "cs_snap", "object": "checkout.session", "customer": "cus_linked", "subscription": "sub_1",
               "client_reference_id": "user-7", "mode": "subscription", "status": "complete",
               "payment_status": "paid"}
    assert fetched(kit, session, T0, account="acct_1Snap") is True
    assert kit.query("SELECT id, customer_id, client_reference_id, account FROM billing.checkout_sessions") == [
        {"id": "cs_snap", "customer_id": "cus_linked", "client_reference_id": "user-7", "account": "acct_1Snap"}]
    # The stub any customer.* event overwrites (ordering key -infinity), of the session's account.
    assert kit.query("SELECT id, account, source_event_created = '-infinity' AS stub FROM billing.customers") == [
        {"id": "cus_linked", "account": "acct_1Snap", "stub": True}]


def test_a_snapshot_of_another_account_is_refused_and_writes_nothing(kit):
    assert fetched(kit, customer("platform@example.test"), T0) is True
    before = {t: kit.query(f"SELECT * FROM billing.{t}") for t in ("customers", "objects")}
    with pytest.raises(psycopg.errors.CheckViolation) as refused:
        fetched(kit, customer("connected@example.test"), T0 + 5, account="acct_1Snap")
    assert refused.value.diag.constraint_name == "billing_row_owner"
    assert {t: kit.query(f"SELECT * FROM billing.{t}") for t in ("customers", "objects")} == before


def test_an_object_a_row_needs_a_field_of_is_refused_before_any_write(kit):
    from workers.failures import UnmappablePayload

    with pytest.raises(UnmappablePayload, match="data.object.status"):
        fetched(kit, {"id": "sub_x", "object": "subscription", "customer": "cus_x"}, T0)
    assert set(kit.billing_counts().values()) == {0}


# -- any order of events and snapshots converges ------------------------------------------------------------

STATUSES = ("trialing", "active", "past_due", "active", "canceled", "active")


@st.composite
def timelines(draw):
    """Changes of one subscription at Stripe (the event of each, created in the second it happened), and
    snapshots fetched at moments in between, each showing the latest change made before it. Fetches are drawn
    near the changes on purpose: just before one, in its own second, is where a wrong key goes wrong."""
    n = draw(st.integers(2, len(STATUSES)))
    gaps = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))  # 0: the same second as the one before
    seconds = [T0 + sum(gaps[:i + 1]) for i in range(n)]
    # When in its second each change happened: increasing within a second, never at its very start.
    moments, last = [], None
    for second in seconds:
        low = 0.1 if last is None or int(last) < second else last - second + 0.01
        last = second + draw(st.floats(low, min(low + 0.3, 0.98)))
        moments.append(last)

    def fetch_time(choice) -> float:
        j, where, fraction = choice
        if where == "before" and j > 0:  # in the change's second, before it: the older state
            start = max(seconds[j], moments[j - 1])
            return start + fraction * (moments[j] - start)
        if where == "after":
            return moments[j] + fraction * 0.9
        return moments[0] + fraction * (seconds[-1] + 1.99 - moments[0])

    choices = draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(["before", "after", "anywhere"]),
                                      st.floats(0, 0.999)), max_size=3))
    fetches = [fetch_time(c) for c in choices]
    order = draw(st.permutations(range(n + len(fetches))))
    return seconds, moments, fetches, order


@hypothesis_settings(max_examples=40, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(timeline=timelines())
def test_any_order_of_events_and_snapshots_ends_at_the_newest_state(kit, timeline):
    seconds, moments, fetches, order = timeline
    processor = kit.__dict__.setdefault("_snapshot_processor", kit.processor(modules=()))
    kit.wipe()
    history = SubscriptionHistory(start=T0 - 86400)

    states = [{**history._subscription(STATUSES[i], history.start), "quantity": i + 1}  # each tells itself apart
              for i in range(len(seconds))]

    # Ids increase with time, so that same-second events sort in the order they happened (as Stripe's do not
    # have to: that tie is the events' own, see test_billing_ordering).
    events = [event("customer.subscription.updated", states[i], created=second, event_id=f"evt_snap_{i:03d}")
              for i, second in enumerate(seconds)]
    snapshots = [(states[max(i for i, m in enumerate(moments) if m <= t)], t) for t in fetches]
    for index in order:
        if index < len(events):
            process(kit, processor, events[index])
        else:
            obj, fetched_at = snapshots[index - len(events)]
            fetched(kit, obj, fetched_at)

    newest = len(seconds) - 1
    sub = row(kit, "subscriptions")
    assert (sub["quantity"], sub["status"]) == (newest + 1, STATUSES[newest]), timeline
    mirror = row(kit, "objects")
    assert mirror["data"] == states[newest]
    assert (mirror["source_event_id"], mirror["source_event_created"]) == (
        sub["source_event_id"], sub["source_event_created"])
    granted = kit.query("SELECT feature FROM billing.entitlements ORDER BY 1")
    assert granted == ([{"feature": f} for f in sorted(history.features)]
                       if STATUSES[newest] in ("active", "trialing") else [])
    assert kit.query("SELECT count(*) AS n FROM billing.subscription_transitions") == [{"n": len(events)}]
