"""Thin event notifications: what a worker fetches for one, before and outside the apply transaction.

A thin notification (recorded by /webhooks/stripe/thin) carries ids, not objects. Before
the apply transaction opens, ``ThinFetcher.fetch`` turns the claimed notification into the
event its handlers take (``Applied``):

* ``v1.<type>`` (``v1.customer.subscription.updated``): the v2 event first, for the id of
  the snapshot event of the same change (``snapshot_event``), then the related object,
  fetched now from ``related_object.url``. The object becomes ``data.object`` of an event of
  the snapshot type ``<type>``, so the handlers of ``<type>`` (built-in and a user's) apply
  it, under the order guard with the notification's ``created``, and keyed by the snapshot
  event's id when there is one: a change that also comes as a snapshot event (both payload
  styles subscribed, or catch-up listing it) writes the same rows, transitions and effects
  once. For a deletion (``v1.invoice.deleted``) a 404 is the answer expected: the object
  becomes Stripe's deleted stub (id, object, ``deleted: true``). The object is at least as new as
  the notification: an older key on newer data is the safe direction (docs/stripe-api.md,
  "Fetched objects and the order guard"), and a later notification of the same object carries a
  later key.
* ``v2.*`` types: the v2 event (``/v2/core/events/{id}``), its ``data`` as it is. For
  ``v2.core.health.event_generation_failure.resolved`` also the object whose event Stripe
  failed to generate (``data.impact``), fetched as a snapshot (workers/health.py applies it
  and records the alert). A v2 type no handler is registered for is refused before any
  fetch (the processor's ``unsupported_type``).

Each request is made once (``RetryRule(attempts=1)``), sent with the notification's
``context`` (its connected account) as Stripe-Context: a 429, a 5xx, a timeout fails the
attempt recoverably, Stripe's Retry-After the least wait, and the ledger retries it on our
own schedule with no lease or connection held meanwhile; a 404 or a refused key is
permanent, with the reason (workers.failures classifies StripeApiError). Nothing here
touches Postgres.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import stripe

from ledger.attempts import Claim
from ledger.config import Settings
from ledger.reprojection import StoredEvent
from ledger.stripe_events import HEALTH_GENERATION_FAILURE, V1_PREFIX, handler_type, is_deletion, is_thin
from workers.failures import PermanentError
from workers.stripe_api import COLLECTIONS, PermanentApiError, RetryRule, StripeApi

V2_EVENTS = "/v2/core/events"

# object type -> the API path it is retrieved under (a health alert names the type and id only;
# its url is the Dashboard's).
_PATHS = {collection.object: collection.path for collection in COLLECTIONS.values()}


class MissingStripeKey(PermanentError):
    """A thin notification needs the API and STRIPE_API_KEY is not set: set it, then replay."""

    reason = "stripe_api_key_missing"

    def __init__(self):
        super().__init__("a thin event notification is fetched from Stripe's API and STRIPE_API_KEY is not set; "
                         "set it on the workers, then ledgerctl replay")


class KeyOfAnotherMode(PermanentError):
    """The notification's mode is not the API key's: Stripe would answer 404 for every object of it."""

    reason = "stripe_api_key_mode"

    def __init__(self, livemode: bool):
        mode, other = ("live", "test") if livemode else ("test", "live")
        super().__init__(f"a {mode} mode notification cannot be fetched with the workers' {other} mode "
                         "STRIPE_API_KEY; set LEDGER_ACCEPT_LIVEMODE so the receiver refuses that mode, or give "
                         "those workers a key of its mode")


@dataclass(frozen=True)
class Fetched:
    """The object a thin notification was applied as: what the ledger keeps of it (migration 0016)."""
    object: dict[str, Any]
    at: datetime
    api_version: str | None


@dataclass(frozen=True)
class Applied:
    """The event a claim's handlers take: ``event`` is what ApplyContext.event holds; ``snapshot_twin``
    the id of the snapshot event of the same change, when Stripe names one (ApplyContext.event_id);
    ``fetched`` the object a thin notification was applied as."""
    type: str
    event: dict[str, Any]
    snapshot_twin: str | None = None
    fetched: Fetched | None = None


def applied(claim: Claim) -> Applied:
    """A snapshot event's, as it was delivered: nothing to fetch."""
    return Applied(claim.type, claim.payload)


def stored(event: StoredEvent) -> Applied:
    """What a processed event's handlers took, from the ledger alone (a rebuild): a snapshot event as
    delivered; a thin notification as the object its worker fetched, which the ledger kept."""
    if not is_thin(event.payload) or event.applied_object is None:
        return Applied(event.type, event.payload)
    return _related_event(event.type, event.id, event.created, event.livemode, event.account, event.payload,
                          event.applied_object, event.applied_as, event.applied_api_version)


def _related_event(notification_type: str, notification_id: str, created: datetime, livemode: bool,
                   account: str | None, notification: dict[str, Any], obj: dict[str, Any], twin: str | None,
                   api_version: str | None) -> Applied:
    """A v1 notification's object as ``data.object`` of an event of its snapshot type, keyed by the snapshot
    event of the same change when there is one: what its handlers take, fetched now or kept."""
    snapshot_type = handler_type(notification_type)
    event = {"id": twin or notification_id, "object": "event", "type": snapshot_type,
             "created": created.timestamp(), "livemode": livemode, "account": account,
             "api_version": api_version, "data": {"object": obj},
             "thin": {"id": notification_id, "type": notification_type,
                      "related_object": notification["related_object"]}}
    return Applied(snapshot_type, event, snapshot_twin=twin)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def collection_path(object_type: str) -> str | None:
    """The API path objects of this type are retrieved under (``/v1/subscriptions``), None for a type this
    worker cannot retrieve."""
    return _PATHS.get(object_type)


class ThinFetcher:
    """Fetches for thin notifications (see the module docstring). The client is made on first use:
    a worker that never meets a thin notification needs no STRIPE_API_KEY."""

    def __init__(self, settings: Settings):
        self._settings = settings
        self._api: StripeApi | None = None
        # fetch() runs in several threads at once (a batch's notifications): the client is made once.
        # Its HTTP sessions are per thread (stripe's RequestsClient).
        self._lock = threading.Lock()

    def fetch(self, claim: Claim) -> Applied:
        notification = claim.payload
        api = self._api_client()
        if api.livemode is not None and api.livemode != claim.livemode:
            raise KeyOfAnotherMode(claim.livemode)
        if claim.type.startswith(V1_PREFIX):
            return self._related_object(claim, notification)
        v2_event, _ = self._get(f"{V2_EVENTS}/{claim.event_id}", claim.account)
        event = {**v2_event, "id": claim.event_id, "type": claim.type}
        if claim.type == HEALTH_GENERATION_FAILURE:
            event["fetched"] = self._impacted_object(event, claim.account)
        return Applied(claim.type, event)

    def _related_object(self, claim: Claim, notification: dict[str, Any]) -> Applied:
        related = notification["related_object"]  # its shape was checked by the receiver
        twin = self._snapshot_twin(claim)
        try:
            obj, fetched_at = self._get(related["url"], claim.account)
        except PermanentApiError as exc:
            if exc.status != 404 or not is_deletion(handler_type(claim.type), {}):
                raise
            # What a deletion leaves: Stripe answers 404 for most deleted objects (a customer's
            # deleted stub is its answer), and the rows are marked deleted from that stub.
            obj, fetched_at = {"id": related["id"], "object": related["type"], "deleted": True}, utcnow()
        # The version Stripe rendered the object at: the client library's own (no Stripe-Version is set),
        # which a library upgrade moves; handlers' required fields guard that.
        event = _related_event(claim.type, claim.event_id, claim.created, claim.livemode, claim.account,
                               notification, obj, twin, stripe.api_version)
        return dataclasses.replace(event, fetched=Fetched(obj, fetched_at, stripe.api_version))

    def _snapshot_twin(self, claim: Claim) -> str | None:
        """The snapshot event of the same change (the v2 event's ``snapshot_event``). None when Stripe
        names none, or no longer has the v2 event (it keeps them 30 days: a late replay)."""
        v2_event, _ = self._api_client().retrieve(V2_EVENTS, claim.event_id, context=claim.account)
        twin = (v2_event or {}).get("snapshot_event")
        return twin if isinstance(twin, str) and twin.startswith("evt_") and twin != claim.event_id else None

    def _impacted_object(self, event: dict[str, Any], context: str | None) -> dict[str, Any]:
        """What data.impact names, fetched now: {"outcome", "object", "fetched_at", "account"}."""
        impact = (event.get("data") or {}).get("impact") or {}
        related = impact.get("related_object") or {}
        object_type = related.get("type")
        object_id = related.get("id") or impact.get("related_object_id")
        account = impact.get("context") or context
        path = collection_path(object_type) if isinstance(object_type, str) and isinstance(object_id, str) else None
        if path is None:
            return {"account": account, "object": None, "fetched_at": None, "outcome": "unsupported_object_type"}
        obj, fetched_at = self._api_client().retrieve(path, object_id, context=account)
        return {"account": account, "object": obj, "fetched_at": fetched_at,
                "outcome": "applied" if obj is not None else "object_not_found"}

    def _get(self, path: str, context: str | None) -> tuple[dict[str, Any], datetime]:
        return self._api_client().get(path, context=context)

    def _api_client(self) -> StripeApi:
        if not self._settings.stripe_api_key:
            raise MissingStripeKey()
        with self._lock:
            if self._api is None:
                self._api = StripeApi(self._settings, rule=RetryRule(
                    attempts=1, timeout_s=self._settings.stripe_fetch_timeout_s))
            return self._api
