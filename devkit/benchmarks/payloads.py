"""Real-size Stripe deliveries for the benchmarks.

Two sources, both shaped like what Stripe sends (pretty-printed JSON, as Stripe's
webhook bodies are):

* the shared fixture corpus (``shared/stripe-fixtures``: real events copied from
  public repositories), each re-issued under a fresh event id;
* generated subscription lifecycles (``devkit.factories.SubscriptionHistory``), whose
  objects are dressed in the full field set of the corpus' own subscription,
  invoice and customer objects, so that they carry the fields a real event carries
  (a generated field always wins over the dressing, so the mapping sees exactly
  the lifecycle the factory built).
"""
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

# The corpus objects that dress generated ones (2020-08-27, the factory's default API version).
_SHAPES = {"subscription": "customer.subscription.updated__rubymock_1.json",
           "invoice": "invoice.paid__rubymock_1.json",
           "customer": "customer.updated__rubymock_1.json"}

# Fields of the dressing shapes that basil-era (2025-03-31) objects no longer carry there.
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


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES_DIR / name).read_text())


def fixture_templates(min_bytes: int = MIN_INGEST_BYTES, max_bytes: int = MAX_INGEST_BYTES) -> list[dict[str, Any]]:
    """Corpus events whose body is within the size range (empty if the corpus is missing)."""
    found = []
    for path in sorted(FIXTURES_DIR.glob("*.json")):
        size = path.stat().st_size
        if min_bytes <= size <= max_bytes:
            evt = json.loads(path.read_text())
            if isinstance(evt, dict) and isinstance(evt.get("data"), dict):
                found.append(evt)
    return found


class _Dresser:
    def __init__(self):
        self.shapes = {}
        for kind, name in _SHAPES.items():
            try:
                self.shapes[kind] = _load(name)["data"]["object"]
            except (OSError, KeyError, ValueError):
                self.shapes[kind] = {}

    def dress(self, evt: dict[str, Any]) -> dict[str, Any]:
        obj = evt["data"]["object"]
        shape = self.shapes.get(obj.get("object"), {})
        if not shape:
            return evt
        dressed = copy.deepcopy(shape)
        if evt.get("api_version", "") >= BASIL_API:
            # The corpus' shapes are 2020-08-27 objects: leave out what basil moved (the
            # subscription's period to its items, the invoice's subscription to its parent).
            for moved in _MOVED_BY_BASIL.get(obj.get("object"), ()):
                dressed.pop(moved, None)
        dressed.update(obj)
        if obj.get("object") == "subscription":
            self._dress_items(dressed, obj, shape)
        if obj.get("object") == "invoice":
            dressed["customer_email"] = f"{obj['customer']}@example.test"
            dressed["hosted_invoice_url"] = f"https://invoice.stripe.com/i/acct_bench/{obj['id']}"
            dressed["invoice_pdf"] = dressed["hosted_invoice_url"] + "/pdf"
            dressed["number"] = obj["id"][-8:].upper() + "-0001"
            dressed["total"] = dressed["subtotal"] = obj.get("amount_due")
        if obj.get("object") == "customer":
            dressed["invoice_prefix"] = obj["id"][-8:].upper()
        return {**evt, "data": {**evt["data"], "object": dressed}}

    @staticmethod
    def _dress_items(dressed: dict, obj: dict, shape: dict) -> None:
        shape_items = shape.get("items") or {}
        shape_item = (shape_items.get("data") or [{}])[0]
        items = []
        for item in obj["items"]["data"]:
            full = copy.deepcopy(shape_item)
            full.update(item)
            for key in ("price", "plan"):
                if isinstance(shape_item.get(key), dict) and isinstance(item.get(key), dict):
                    full[key] = {**copy.deepcopy(shape_item[key]), **item[key]}
            items.append(full)
        dressed["items"] = {**copy.deepcopy(shape_items), **obj["items"], "data": items,
                            "url": f"/v1/subscription_items?subscription={obj['id']}"}
        if isinstance(shape.get("plan"), dict) and isinstance(obj.get("plan"), dict):
            dressed["plan"] = {**copy.deepcopy(shape["plan"]), **obj["plan"]}


def lifecycles(count: int, *, seed: int = 7, window_s: int = 3600,
               api_version: str = OLD_API) -> list[dict[str, Any]]:
    """``count`` subscription lifecycles (10 events each: customer, subscription changes, invoices),

    interleaved the way they reach us from many customers at once: each lifecycle
    starts at a random time in ``window_s`` and the union is ordered by ``created``.
    ``api_version`` chooses the objects' shape (``BASIL_API``: periods on the items,
    the invoice's subscription under ``parent``).
    """
    rng = random.Random(seed)
    dresser = _Dresser()
    events = []
    base = int(time.time()) - 86400
    for _ in range(count):
        history = SubscriptionHistory(start=base + rng.randrange(window_s), api_version=api_version).lifecycle()
        events.extend(dresser.dress(e) for e in history.events)
    events.sort(key=lambda e: (e["created"], e["id"]))
    return events


def ingest_templates(lifecycle_count: int = 40) -> list[dict[str, Any]]:
    """The ingest mix: corpus events and generated lifecycle events, all 3-10 KB."""
    templates = fixture_templates()
    for evt in lifecycles(lifecycle_count, seed=11):
        if MIN_INGEST_BYTES <= len(body(evt)) <= MAX_INGEST_BYTES:
            templates.append(evt)
    return templates


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
    """``snapshots`` (ordered by ``created``) as an event destination sends them, thin.

    A fetch answers the object as it is now, not as the event saw it; the API holds each object
    in the state of its last event, what a worker that fetches after the whole burst would get.
    ``name_snapshot_twin``: each v2 event names its snapshot event (``snapshot_event``), as
    Stripe's do when it generated one for the same change.
    """
    notifications, v2_events, objects = [], [], {}
    for evt in snapshots:
        note = thin_twin(evt)
        notifications.append(note)
        v2 = v2_event(note)
        if name_snapshot_twin:
            v2["snapshot_event"] = evt["id"]
        v2_events.append(v2)
        obj = evt["data"]["object"]
        objects[obj["id"]] = obj
    return ThinLoad(notifications, v2_events, list(objects.values()))


def signed_deliveries(templates: list[dict[str, Any]], count: int, secret: str, *,
                      seed: int = 1) -> list[SignedDelivery]:
    """``count`` deliveries, each a template re-issued under a new event id and signed now."""
    rng = random.Random(seed)
    now = int(time.time())
    out = []
    for _ in range(count):
        evt = dict(rng.choice(templates))
        evt["id"] = event_id()
        text = body(evt)
        out.append(SignedDelivery(evt["id"], text, sign(text, secret, timestamp=now)))
    return out


def size_stats(bodies: Iterable[str]) -> dict[str, float]:
    sizes = sorted(len(b.encode()) for b in bodies)
    if not sizes:
        return {}
    return {"n": len(sizes), "min_kb": sizes[0] / 1024, "median_kb": statistics.median(sizes) / 1024,
            "mean_kb": statistics.fmean(sizes) / 1024, "max_kb": sizes[-1] / 1024}
