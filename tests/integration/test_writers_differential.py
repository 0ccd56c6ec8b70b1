"""One mapping, three writers, the same rows: random streams of billing events applied one event per
transaction, by the live writer over random batch splits, and by the rebuild's slice writer (COPY), on
real Postgres, each into its own copy of the billing tables.

The streams are shuffled (delivery order is not Stripe's), redelivered, full of same-second ties, of
deletes, and of several events of one object that a split puts in different batches. What must hold:

* every table that holds state (all but subscription_transitions) comes out the same every way: the
  order guard makes it independent of the order events are applied in, and of how they are batched;
* subscription_transitions records the history as applied (from_status: the status before the event),
  so it is the same for the same order: the live writer's equals one event per transaction in the order
  the worker applies them (each batch in Stripe's order), and the rebuild's equals one event per
  transaction in Stripe's order (the order it reads the ledger in).

Every column is compared but those that say when a row was written.
"""
from __future__ import annotations

import os
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from workers.billing import tables as billing
from workers.handlers import ApplyContext
from workers.registry import load_handlers
from workers.writers import LiveWriter, SliceWriter

WAYS = ("one_by_one", "batches", "slices", "stripe_order", "batch_order")
WRITTEN_AT = ("updated_at", "recorded_at", "granted_at")
TABLES = [table.relation for table in billing.ALL]
T0 = 1_760_000_000

CUSTOMERS = ("cus_a", "cus_b")
SUBSCRIPTIONS = {"sub_1": "cus_a", "sub_2": "cus_a", "sub_3": "cus_b"}
INVOICES = {"in_1": ("cus_a", "sub_1"), "in_2": ("cus_b", "sub_3")}
SESSIONS = {"cs_1": ("cus_a", "sub_1"), "cs_2": ("cus_c", None)}  # cus_c is only ever known by id
STATUSES = ("trialing", "active", "past_due", "canceled")
FEATURES = ("", "seats", "seats,sso", "sso,api")


def _subscription(sub_id: str, n: int, status: str, features: str) -> dict:
    return {"id": sub_id, "object": "subscription", "customer": SUBSCRIPTIONS[sub_id], "status": status,
            "cancel_at_period_end": n % 2 == 0, "current_period_start": T0 + n, "current_period_end": T0 + n + 30,
            "items": {"data": [{"price": {"id": f"price_{n % 3}", "product": f"prod_{n % 2}",
                                          "metadata": {"features": features}}, "quantity": n % 4 + 1}]}}


@st.composite
def changes(draw, n: int) -> tuple[str, dict]:
    """One event's type and object."""
    kind = draw(st.sampled_from(("customer", "customer", "subscription", "subscription", "subscription",
                                 "invoice", "invoice", "checkout", "summary")))
    if kind == "customer":
        cus = draw(st.sampled_from(CUSTOMERS))
        if draw(st.integers(0, 5)) == 0:
            return "customer.deleted", {"id": cus, "object": "customer", "deleted": True}
        return draw(st.sampled_from(("customer.created", "customer.updated"))), {
            "id": cus, "object": "customer", "email": f"{cus}-{n}@example.test", "name": f"n{n}",
            "metadata": {"n": str(n)}}
    if kind == "subscription":
        sub = draw(st.sampled_from(sorted(SUBSCRIPTIONS)))
        status = draw(st.sampled_from(STATUSES))
        event_type = ("customer.subscription.deleted" if status == "canceled" and draw(st.booleans())
                      else draw(st.sampled_from(("customer.subscription.created", "customer.subscription.updated"))))
        return event_type, _subscription(sub, n, status, draw(st.sampled_from(FEATURES)))
    if kind == "invoice":
        inv = draw(st.sampled_from(sorted(INVOICES)))
        cus, sub = INVOICES[inv]
        event_type = draw(st.sampled_from(("invoice.created", "invoice.paid", "invoice.payment_failed",
                                           "invoice.deleted")))
        return event_type, {"id": inv, "object": "invoice", "customer": cus, "subscription": sub,
                            "status": draw(st.sampled_from(("draft", "open", "paid"))), "amount_due": 100 * n,
                            "amount_paid": n, "currency": "usd", "period_start": T0, "period_end": T0 + n}
    if kind == "checkout":
        cs = draw(st.sampled_from(sorted(SESSIONS)))
        cus, sub = SESSIONS[cs]
        return "checkout.session.completed", {
            "id": cs, "object": "checkout.session", "customer": cus, "subscription": sub,
            "client_reference_id": f"user-{n}", "mode": "subscription", "status": "complete",
            "payment_status": "paid"}
    cus = draw(st.sampled_from(CUSTOMERS))
    keys = draw(st.lists(st.sampled_from(("seats", "sso", "api", "audit")), unique=True, max_size=3))
    return "entitlements.active_entitlement_summary.updated", {
        "object": "entitlements.active_entitlement_summary", "customer": cus,
        "entitlements": {"object": "list", "data": [{"object": "entitlements.active_entitlement",
                                                     "lookup_key": k, "feature": f"feat_{k}"} for k in keys]}}


@st.composite
def streams(draw) -> tuple[list[dict], list[int], list[int]]:
    """(the deliveries, in delivery order: shuffled, some events twice; the batch sizes splitting them;
    the slice sizes splitting the ledger's events in Stripe's order)."""
    count = draw(st.integers(1, 24))
    ids = draw(st.lists(st.text("0123456789abcdef", min_size=8, max_size=8), min_size=count, max_size=count,
                        unique=True))
    events = []
    for n, suffix in enumerate(ids):
        event_type, obj = draw(changes(n))
        # A few seconds for many events: same-second ties everywhere, broken by the event id.
        events.append({"id": f"evt_{suffix}", "object": "event", "type": event_type, "livemode": False,
                       "created": T0 + draw(st.integers(0, 4)), "api_version": "2020-08-27",
                       "data": {"object": obj}})
    again = draw(st.lists(st.sampled_from(events), max_size=6))
    deliveries = draw(st.permutations(events + again))
    return deliveries, _split(draw, len(deliveries)), _split(draw, len(events))


def _split(draw, total: int) -> list[int]:
    sizes = []
    while sum(sizes) < total:
        sizes.append(draw(st.integers(1, max(1, total - sum(sizes)))))
    return sizes


def _stripe_order(events: list[dict]) -> list[dict]:
    return sorted(events, key=lambda e: (e["created"], e["id"]))


def _chunks(events: list[dict], sizes: list[int]) -> list[list[dict]]:
    out, at = [], 0
    for size in sizes:
        out.append(events[at:at + size])
        at += size
    return out


@pytest.fixture
def ways(kit):
    """A copy of the billing tables for each way of applying a stream (made as a rebuild makes its shadow)."""
    with kit.connect() as conn:
        for way in WAYS:
            conn.execute("SELECT ledger.reprojection_make_shadow(%s, %s)", (way, TABLES))
        conn.commit()
    yield kit
    with kit.connect() as conn:
        for way in WAYS:
            conn.execute(f"DROP SCHEMA IF EXISTS {way} CASCADE")
        conn.commit()


class Applier:
    """The worker's handlers, applied to a stream of events, into one schema's tables."""

    def __init__(self, kit):
        self.kit = kit
        self.registry = load_handlers(kit.settings)

    def record(self, writer, conn, evt: dict) -> None:
        event_type = evt["type"]
        self.registry.check_required(event_type, evt, evt["api_version"])
        created = datetime.fromtimestamp(evt["created"], tz=timezone.utc)
        self.registry.apply(ApplyContext(
            conn=conn, event_id=evt["id"], event_type=event_type, created=created, livemode=False, account=None,
            event=evt, attempt=1, rows=writer.rows_for(event_id=evt["id"], created=created, account=None,
                                                       livemode=False)))

    def live(self, schema: str, batches: list[list[dict]]) -> None:
        """Each batch in a transaction of its own, as a worker applies it: its events in Stripe's order."""
        with self.kit.connect() as conn:
            for batch in batches:
                with conn.transaction():
                    writer = LiveWriter(conn, {"billing": schema})
                    for evt in _stripe_order(batch):
                        self.record(writer, conn, evt)
                    writer.flush()

    def slices(self, schema: str, slices: list[list[dict]]) -> None:
        """Each slice as a rebuild writes it: its rows kept in memory, then COPY and one statement per table."""
        with self.kit.connect() as conn:
            writer = SliceWriter(conn, {"billing": schema})
            for events in slices:
                with conn.transaction():
                    for evt in events:
                        self.record(writer, conn, evt)
                    writer.flush()

    def rows(self, schema: str) -> dict[str, dict[tuple, dict]]:
        out = {}
        for table in billing.ALL:
            found = self.kit.query(f"SELECT to_jsonb(t) - %s::text[] AS r FROM {schema}.{table.relation} t",
                                   (list(WRITTEN_AT),))
            out[table.relation] = {tuple(str(r["r"].get(c)) for c in table.key): r["r"] for r in found}
        return out

    def wipe(self) -> None:
        self.kit.execute("TRUNCATE " + ", ".join(f"{way}.{t}" for way in WAYS for t in TABLES))


@hypothesis_settings(max_examples=int(os.environ.get("DIFFERENTIAL_EXAMPLES", "60")), deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                     # ops/sabotage only asks whether a bug is caught: no minutes spent shrinking the example.
                     phases=[p for p in Phase if not (os.environ.get("SABOTAGE_RUN") and p is Phase.shrink)])
@given(stream=streams())
def test_one_event_at_a_time_live_batches_and_rebuild_slices_give_the_same_tables(ways, stream):
    deliveries, batch_sizes, slice_sizes = stream
    applier = Applier(ways)
    applier.wipe()
    batches = _chunks(deliveries, batch_sizes)
    ledger = _stripe_order(list({e["id"]: e for e in deliveries}.values()))  # each event once, as the ledger has it

    applier.live("one_by_one", [[evt] for evt in deliveries])
    applier.live("batches", batches)
    applier.slices("slices", _chunks(ledger, slice_sizes))
    applier.live("stripe_order", [[evt] for evt in ledger])
    applier.live("batch_order", [[evt] for batch in batches for evt in _stripe_order(batch)])
    got = {way: applier.rows(way) for way in WAYS}

    history = billing.TRANSITIONS.relation
    for way in ("batches", "slices", "stripe_order"):
        for table in TABLES:
            if table != history:
                assert got[way][table] == got["one_by_one"][table], (way, table)
    assert got["batches"][history] == got["batch_order"][history]
    assert got["slices"][history] == got["stripe_order"][history]
    # Nothing is lost either: every object of the stream has its rows.
    objects = {(e["data"]["object"].get("id"),) for e in deliveries if e["data"]["object"].get("id")}
    assert {k[:1] for k in got["slices"]["objects"]} == objects
