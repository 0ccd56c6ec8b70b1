"""The object a snapshot event is about and that object's customer, as the receiver records them
(ledger.stripe_events.object_and_customer): the same rule as ledger.reprojection_key, which a rebuild
parts a ledger's events by, so that one customer's events all go to one part."""
from __future__ import annotations

import json

import pytest

from ledger.stripe_events import object_and_customer, parse_event

T0 = 1_760_000_000


def body(obj: dict) -> bytes:
    return json.dumps({"id": "evt_keys_1", "object": "event", "type": "x.updated", "created": T0,
                       "livemode": False, "data": {"object": obj}}).encode()


@pytest.mark.parametrize("obj, keys", [
    ({"id": "sub_1", "customer": "cus_1"}, ("sub_1", "cus_1")),
    ({"id": "in_1", "customer": {"id": "cus_2", "object": "customer"}}, ("in_1", "cus_2")),
    ({"id": "sub_2", "customer": None, "customer_account": "acct_1"}, ("sub_2", "acct_1")),
    ({"id": "cus_3", "object": "customer"}, ("cus_3", None)),
    ({"object": "entitlements.active_entitlement_summary", "customer": "cus_4"}, (None, "cus_4")),
    ({"id": "x" * 300, "customer": 7}, (None, None)),
])
def test_an_event_records_its_objects_id_and_its_customer(obj, keys):
    recorded = parse_event(body(obj))
    assert (recorded.object_id, recorded.customer_id) == keys == object_and_customer(obj)
