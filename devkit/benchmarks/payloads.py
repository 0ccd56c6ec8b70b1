"""Real-size Stripe deliveries, pretty-printed as Stripe sends them: the shared fixture corpus' real events, and
generated subscription lifecycles dressed in the full field set of the corpus' own objects (a generated field
always wins, so the mapping sees exactly the lifecycle the factory built)."""
from __future__ import annotations

import copy
import json
import os
import random
import secrets
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from devkit.factories import BASIL_API, OLD_API, SubscriptionHistory, sign, thin_twin, v2_event
from devkit.procs import REPO

FIXTURES_DIR = Path(os.environ.get("BENCH_FIXTURES_DIR", REPO.parent / "shared" / "stripe-fixtures"))
# The corpus objects that dress generated ones (2020-08-27, the factory's default API version), and the fields
# basil (2025-03-31) moved elsewhere (the subscription's period to its items, the invoice's subscription to parent).
_SHAPES = {"subscription": "customer.subscription.updated__rubymock_1.json",
           "invoice": "invoice.paid__rubymock_1.json",
           "customer": "customer.updated__rubymock_1.json"}
_MOVED_BY_BASIL = {"subscription": ("current_period_start", "current_period_end"), "invoice": ("subscription",)}
# The receiver's endpoints: snapshot events, and the thin notifications of an event destination.
SNAPSHOT_PATH = "/webhooks/stripe"
THIN_PATH = "/webhooks/stripe/thin"
MIN_INGEST_BYTES = 3 * 1024
MAX_INGEST_BYTES = 10 * 1024


def event_id() -> str:
    return "evt_bench_" + secrets.token_hex(12)


def body(evt: dict[str, Any]) -> str:
    """The body as Stripe sends it: pretty-printed JSON."""
    return json.dumps(evt, indent=2)


def fixture_templates(min_bytes: int = MIN_INGEST_BYTES, max_bytes: int = MAX_INGEST_BYTES) -> list[dict[str, Any]]:
    """Corpus events whose body is within the size range (empty if the corpus is missing)."""
    found = [json.loads(p.read_text()) for p in sorted(FIXTURES_DIR.glob("*.json"))
             if min_bytes <= p.stat().st_size <= max_bytes]
    return [evt for evt in found if isinstance(evt, dict) and isinstance(evt.get("data"), dict)]


def _shapes() -> dict[str, dict[str, Any]]:
    shapes = {}
    for kind, name in _SHAPES.items():
        try:
            shapes[kind] = json.loads((FIXTURES_DIR / name).read_text())["data"]["object"]
        except (OSError, KeyError, ValueError):
            shapes[kind] = {}
    return shapes


def _dress(evt: dict[str, Any], shapes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    obj = evt["data"]["object"]
    kind = obj.get("object")
    shape = shapes.get(kind, {})
    if not shape:
        return evt
    dressed = copy.deepcopy(shape)
    if evt.get("api_version", "") >= BASIL_API:
        for moved in _MOVED_BY_BASIL.get(kind, ()):
            dressed.pop(moved, None)
    dressed.update(obj)
    if kind == "subscription":
        shape_items = shape.get("items") or {}
        shape_item = (shape_items.get("data") or [{}])[0]
        items = []
        for item in obj["items"]["data"]:
            full = {**copy.deepcopy(shape_item), **item}
            for key in ("price", "plan"):
                if isinstance(shape_item.get(key), dict) and isinstance(item.get(key), dict):
                    full[key] = {**copy.deepcopy(shape_item[key]), **item[key]}
            items.append(full)
        dressed["items"] = {**copy.deepcopy(shape_items), **obj["items"], "data": items,
                            "url": f"/v1/subscription_items?subscription={obj['id']}"}
        if isinstance(shape.get("plan"), dict) and isinstance(obj.get("plan"), dict):
            dressed["plan"] = {**copy.deepcopy(shape["plan"]), **obj["plan"]}
    if kind == "invoice":
        dressed["customer_email"] = f"{obj['customer']}@example.test"
        dressed["hosted_invoice_url"] = f"https://invoice.stripe.com/i/acct_bench/{obj['id']}"
        dressed["invoice_pdf"] = dressed["hosted_invoice_url"] + "/pdf"
        dressed["number"] = obj["id"][-8:].upper() + "-0001"
        dressed["total"] = dressed["subtotal"] = obj.get("amount_due")
    if kind == "customer":
        dressed["invoice_prefix"] = obj["id"][-8:].upper()
    return {**evt, "data": {**evt["data"], "object": dressed}}


def lifecycles(count: int, *, seed: int = 7, window_s: int = 3600,
               api_version: str = OLD_API) -> list[dict[str, Any]]:
    """``count`` subscription lifecycles of 10 events, each starting at a random time in ``window_s``, the union
    ordered by ``created`` (as many customers' reach us); ``api_version`` chooses the objects' shape."""
    rng = random.Random(seed)
    shapes = _shapes()
    base = int(time.time()) - 86400
    events = [_dress(e, shapes) for _ in range(count) for e in SubscriptionHistory(
        start=base + rng.randrange(window_s), api_version=api_version).lifecycle().events]
    return sorted(events, key=lambda e: (e["created"], e["id"]))


def ingest_templates(lifecycle_count: int = 40) -> list[dict[str, Any]]:
    """The ingest mix: corpus events and generated lifecycle events, all 3-10 KB (without the corpus, the
    generated events undressed, smaller: the ingest's payload sizes say so)."""
    generated = lifecycles(lifecycle_count, seed=11)
    found = fixture_templates() + [e for e in generated if MIN_INGEST_BYTES <= len(body(e)) <= MAX_INGEST_BYTES]
    return found or generated


@dataclass(frozen=True)
class SignedDelivery:
    event_id: str
    body: str
    signature: str
    path: str = SNAPSHOT_PATH  # the endpoint it is POSTed to


@dataclass(frozen=True)
class ThinLoad:
    """The thin twins of some snapshot events, and what Stripe's API answers the workers' fetches for them."""
    notifications: list[dict[str, Any]]  # in the snapshot events' order
    v2_events: list[dict[str, Any]]      # GET /v2/core/events/{id} of each, naming its snapshot twin
    objects: list[dict[str, Any]]        # every object a notification names, in its last state


def thin_load(snapshots: Iterable[dict[str, Any]], *, name_snapshot_twin: bool = True) -> ThinLoad:
    """``snapshots`` (ordered by ``created``) as an event destination sends them, thin; the API holds each object
    as its last event left it (what a worker fetching after the burst gets). ``name_snapshot_twin``: each v2
    event names its snapshot event, as Stripe's do when it generated one for the same change."""
    notifications, v2_events, objects = [], [], {}
    for evt in snapshots:
        notifications.append(thin_twin(evt))
        v2_events.append(v2_event(notifications[-1]))
        if name_snapshot_twin:
            v2_events[-1]["snapshot_event"] = evt["id"]
        objects[evt["data"]["object"]["id"]] = evt["data"]["object"]
    return ThinLoad(notifications, v2_events, list(objects.values()))


def signed_deliveries(templates: list[dict[str, Any]], count: int, secret: str, *,
                      seed: int = 1) -> list[SignedDelivery]:
    """``count`` deliveries, each a template re-issued under a new event id and signed now."""
    rng, now, out = random.Random(seed), int(time.time()), []
    for _ in range(count):
        evt = {**rng.choice(templates), "id": event_id()}
        text = body(evt)
        out.append(SignedDelivery(evt["id"], text, sign(text, secret, timestamp=now)))
    return out


def size_stats(bodies: Iterable[str]) -> dict[str, float]:
    sizes = sorted(len(b.encode()) for b in bodies)
    if not sizes:
        return {}
    return {"n": len(sizes), "min_kb": sizes[0] / 1024, "median_kb": statistics.median(sizes) / 1024,
            "mean_kb": statistics.fmean(sizes) / 1024, "max_kb": sizes[-1] / 1024}
