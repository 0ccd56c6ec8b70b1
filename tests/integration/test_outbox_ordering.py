"""Effects of several customers delivered newest first, in-process through the real webhook sender to a real
local backend (tests/support/effect_endpoint.py): the backend, keeping each customer's highest sequence, ends
with every customer's final entitlements."""
from __future__ import annotations

from devkit.factories import SubscriptionHistory
from ledger.outbox import OutboxLedger
from tests.support.effect_endpoint import SECRET
from tests.support.outbox_handlers import customer_features, outbox_processor, outbox_rows
from workers.dispatcher import OutboxDispatcher
from workers.effects import WebhookSender
from workers.retry import RetryPolicy


def test_out_of_order_deliveries_still_leave_the_backend_with_each_customers_final_entitlements(
        kit, effect_endpoint):
    endpoint = effect_endpoint()
    processor = outbox_processor(kit)
    histories = [SubscriptionHistory().lifecycle() for _ in range(4)]
    plans = [(h, h.events[:upto]) for h, upto in zip(histories, (10, 9, 8, 6))]
    for h, events in plans:
        for evt_id in kit.record_many(events):
            assert processor.process(evt_id) == "processed"

    # Sequences follow recording order within each customer.
    for h, events in plans:
        rows = outbox_rows(kit, "ordering_key = %s AND effect = 'entitlements.changed'", (h.customer_id,))
        position = {e["id"]: i for i, e in enumerate(events)}
        assert [position[r["event_id"]] for r in rows] == sorted(position[r["event_id"]] for r in rows)

    # Deliver newest first: every customer's announcements arrive in reverse.
    order = sorted(outbox_rows(kit), key=lambda r: -r["id"])
    sender = WebhookSender(endpoint.url, SECRET, timeout_s=5)
    dispatcher = OutboxDispatcher(ledger=OutboxLedger(kit.pool()),
                                  senders={"entitlements.changed": sender, "invoice.payment_failed": sender},
                                  policy=RetryPolicy(), waker=None, lease_s=30)
    for row in order:
        assert dispatcher.dispatch(row["id"]) == "sent"

    arrivals = endpoint.arrivals("entitlements.changed")
    last_arrived: dict[str, list[str]] = {}
    out_of_order = set()
    for body in arrivals:
        seen = [b["sequence"] for b in arrivals[:arrivals.index(body)] if b["ordering_key"] == body["ordering_key"]]
        if seen and max(seen) > body["sequence"]:
            out_of_order.add(body["ordering_key"])
        last_arrived[body["ordering_key"]] = sorted(body["data"]["entitlements"])
    assert out_of_order == {h.customer_id for h in histories}

    final = endpoint.final_entitlements()
    expected = {h.customer_id: customer_features(kit, h.customer_id) for h in histories}
    assert final == expected
    assert list(expected.values()) == [[], ["reports", "seats"], ["reports", "seats"], []]
    # Whereas "the last one to arrive wins" would be wrong for some customer.
    assert last_arrived != expected
