"""Reconcile: local rows against Stripe's current objects, field by field, and the drift between them.

Stripe's side is the list API (every object of the type, for the account), mapped by
the billing handlers' own pure mapping where a typed table holds the type; the local
side is billing.customers, billing.subscriptions and billing.invoices, and the generic
mirror billing.objects for every other type, for the same account and the API key's
mode. Compared (``TYPED``, ``MIRROR_FIELDS``):

* customers: email, name, deleted
* subscriptions: status, customer, price, quantity, cancel_at_period_end, current period
* invoices: status, customer, subscription, amounts due and paid, currency, period, deleted
* mirrored types: the fields ``MIRROR_FIELDS`` names for the type (status, amounts, ...)

A drift is one of: missing_locally, missing_at_stripe (a local row Stripe does not
list; a deleted one is not drift), stale_status, wrong_period, wrong_amount,
stale_field, or unmappable (Stripe's object lacks a field its row needs). An object
that changed a moment ago may show as drift until its event is processed: run it
again before repairing by hand.

``fix`` applies the fetched objects through the backfill path (so under the order
guard: a row an event of the fetch's second or later wrote is kept, and reported
not fixed); for a row missing at Stripe it retrieves the object by id (a deleted
customer comes back as such) and applies that, or reports it gone.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Callable, Iterable, Mapping, Sequence

from ledger.db import ProcessPool
from ledger.reconcile_runs import ReconcileRuns
from workers.backfill import Backfill, RowOwnedElsewhere
from workers.billing import mapping
from workers.billing.reads import BillingReads
from workers.failures import PermanentError, UnmappablePayload
from workers.stripe_api import Collection, StripeApi

PERIOD_FIELDS = {"current_period_start", "current_period_end", "period_start", "period_end"}
AMOUNT_FIELDS = {"amount", "amount_due", "amount_paid", "amount_received", "amount_refunded", "unit_amount",
                 "currency"}

# Typed tables: the columns compared, and how Stripe's object maps to them (the handlers' mapping).
_Typed = tuple[tuple[str, ...], Callable[[Mapping], dict]]
TYPED: dict[str, _Typed] = {
    "customers": (("email", "name", "deleted"),
                  lambda obj: mapping.customer_row(obj, deleted=False)),
    "subscriptions": (("status", "customer_id", "price_id", "quantity", "cancel_at_period_end",
                       "current_period_start", "current_period_end"),
                      lambda obj: mapping.subscription_row(obj)),
    "invoices": (("status", "customer_id", "subscription_id", "amount_due", "amount_paid", "currency",
                  "period_start", "period_end", "deleted"),
                 lambda obj: {**mapping.invoice_row(obj), "deleted": obj.get("deleted") is True}),
}
# Mirrored types (billing.objects): the fields of the JSON compared, by obj["object"].
MIRROR_FIELDS: dict[str, tuple[str, ...]] = {
    "checkout.session": ("status", "payment_status", "customer", "subscription"),
    "product": ("active", "name"),
    "price": ("active", "unit_amount", "currency", "product"),
    "charge": ("status", "amount", "amount_refunded", "currency", "refunded", "disputed"),
    "payment_intent": ("status", "amount", "amount_received", "currency"),
    "refund": ("status", "amount", "currency"),
    "dispute": ("status", "amount", "currency"),
    "payment_method": ("type", "customer"),
}
DEFAULT_MIRROR_FIELDS = ("status", "amount", "currency")


@dataclass(frozen=True)
class Drift:
    type: str
    id: str
    kind: str
    field: str | None = None
    local: Any = None
    stripe: Any = None


@dataclass
class Fix:
    type: str
    id: str
    fixed: bool
    note: str


@dataclass
class ReconcileResult:
    account: str | None
    checked: dict[str, dict[str, int]] = field(default_factory=dict)   # type -> {"local": n, "stripe": n}
    drift: list[Drift] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)
    # What fix applies: the fetched object and its page's fetch time, per (type, id).
    _fetched: dict[tuple[str, str], tuple[dict, datetime]] = field(default_factory=dict, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"account": self.account, "checked": self.checked, "drift": [asdict(d) for d in self.drift],
                "fixes": [asdict(f) for f in self.fixes],
                "unfixed": sum(not f.fixed for f in self.fixes)}


class Reconcile:
    def __init__(self, pool: ProcessPool, api: StripeApi):
        self._api = api
        self._backfill = Backfill(pool, api)
        self._billing = BillingReads(pool)
        self._runs = ReconcileRuns(pool)

    def run(self, collections: Sequence[Collection], *, account: str | None, fix: bool,
            actor: str) -> ReconcileResult:
        """Compare, fix if asked, and keep the report (ledger.reconcile_runs: the console's drift page and
        the reconcile_drift_objects metric read it)."""
        result = self.compare(collections, account=account)
        if fix:
            self.fix(result, collections)
        self._runs.record(result.as_dict(), actor=actor, types=[c.name for c in collections], fixed=fix)
        return result

    def compare(self, collections: Sequence[Collection], *, account: str | None = None) -> ReconcileResult:
        result = ReconcileResult(account)
        for collection in collections:
            # Stripe first, whole, with no connection of ours open; then the local rows.
            remote = {obj["id"]: (obj, fetched_at)
                      for obj, fetched_at in self._backfill.objects(collection, account=account)}
            local = self._local(collection, account)
            result.checked[collection.name] = {"local": len(local), "stripe": len(remote)}
            for object_id, (obj, fetched_at) in remote.items():
                result._fetched[(collection.name, object_id)] = (obj, fetched_at)
                row = local.get(object_id)
                if row is None:
                    result.drift.append(Drift(collection.name, object_id, "missing_locally"))
                    continue
                result.drift.extend(_field_drift(collection, object_id, row, obj))
            for object_id, row in sorted(local.items()):
                if object_id not in remote and not row.get("deleted"):
                    result.drift.append(Drift(collection.name, object_id, "missing_at_stripe"))
        return result

    def fix(self, result: ReconcileResult, collections: Iterable[Collection]) -> ReconcileResult:
        by_name = {c.name: c for c in collections}
        for type_name, object_id in dict.fromkeys((d.type, d.id) for d in result.drift):
            fetched = result._fetched.get((type_name, object_id))
            if fetched is None:
                obj, fetched_at = self._api.retrieve(by_name[type_name].path, object_id, account=result.account)
                if obj is None:
                    result.fixes.append(Fix(type_name, object_id, False,
                                            "gone at Stripe (404): nothing to apply; the local row stays"))
                    continue
            else:
                obj, fetched_at = fetched
            try:
                written = self._backfill.apply(obj, fetched_at, account=result.account)
            except RowOwnedElsewhere:
                result.fixes.append(Fix(type_name, object_id, False,
                                        "refused: the local row belongs to another account or mode"))
                continue
            except PermanentError as exc:
                result.fixes.append(Fix(type_name, object_id, False, f"cannot be mapped: {exc}"))
                continue
            if written:
                result.fixes.append(Fix(type_name, object_id, True, "applied Stripe's current object"))
            else:
                result.fixes.append(Fix(type_name, object_id, False,
                                        "not applied: the local row was written by an event as new as the "
                                        "fetch or newer; run reconcile again"))
        return result

    def _local(self, collection: Collection, account: str | None) -> dict[str, dict]:
        if collection.name in TYPED:
            rows = self._billing.typed_rows(collection.name, account=account, livemode=self._api.livemode)
        else:
            rows = self._billing.mirrored_rows(collection.object, account=account, livemode=self._api.livemode)
        return {row["id"]: row for row in rows}


def _kind(field_name: str) -> str:
    if field_name == "status":
        return "stale_status"
    if field_name in PERIOD_FIELDS:
        return "wrong_period"
    if field_name in AMOUNT_FIELDS:
        return "wrong_amount"
    return "stale_field"


def _field_drift(collection: Collection, object_id: str, row: dict, obj: dict) -> list[Drift]:
    if collection.name in TYPED:
        fields, to_row = TYPED[collection.name]
        try:
            expected = to_row(obj)
        except UnmappablePayload as exc:
            return [Drift(collection.name, object_id, "unmappable", str(exc))]
        pairs = [(f, row.get(f), expected.get(f)) for f in fields]
    else:
        data = row.get("data") or {}
        fields = MIRROR_FIELDS.get(collection.object, DEFAULT_MIRROR_FIELDS)
        pairs = [(f, _bare(data.get(f)), _bare(obj.get(f))) for f in fields]
        pairs.append(("deleted", bool(row.get("deleted")), obj.get("deleted") is True))
    return [Drift(collection.name, object_id, _kind(f), f, mine, theirs)
            for f, mine, theirs in pairs if mine != theirs]


def _bare(value: Any) -> Any:
    """An expanded object compared by its id, as the mapping does."""
    if isinstance(value, Mapping) and isinstance(value.get("id"), str):
        return value["id"]
    return value
