"""Backfill: Stripe's current objects, listed from the API and applied under the events' order guard.

Each object is applied as soon as its page arrived, in a short transaction of its
own, by workers/billing/snapshots.py (the billing handlers' mapping and guarded
upserts, and the generic mirror billing.objects). Its ordering key is its fetch
time (the second its page was requested, less a margin: workers/stripe_api.py) and
'api_fetch'. So a snapshot never overwrites the state of an event created in that
second or later, and an event created before it, arriving later, never overwrites
the snapshot (docs/stripe-api.md, "Fetched objects and the order guard").

No transaction is open while a page is fetched: a page can take minutes to come
under a rate limit, and the rows it will write are not locked meanwhile.

An object whose row belongs to another account or mode (billing.same_owner refuses
it, constraint billing_row_owner) is counted as refused and skipped: a row never
changes owner. One the mapping cannot map (a field its row needs is missing) is
counted as unmappable and skipped. Either way the rest of the backfill goes on.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, ContextManager, Iterable, Iterator, Sequence

import psycopg

from ledger.db import ProcessPool
from ledger.errors import LedgerError
from workers.billing.snapshots import apply_object
from workers.failures import PermanentError
from workers.stripe_api import COLLECTIONS, Collection, StripeApi

log = logging.getLogger(__name__)

ALL = "all"
ROW_OWNER = "billing_row_owner"  # the constraint name billing.same_owner raises under (migration 0006)


class RowOwnedElsewhere(LedgerError):
    """The object's row belongs to another account or mode: it is not moved."""


@dataclass
class BackfillResult:
    type: str
    fetched: int = 0
    applied: int = 0      # wrote a row (typed or mirror)
    kept: int = 0         # every row it would write was written by something as new or newer: kept as it is
    refused: int = 0      # its row belongs to another account or mode
    unmappable: int = 0   # lacks a field its row needs (the mapping's permanent error, as for an event)


Progress = Callable[[Iterable, str], ContextManager[Iterable]]


def collections_named(names: Sequence[str]) -> list[Collection]:
    """The collections ``names`` name (``all``: every one), in order, each once; ValueError for an unknown name."""
    chosen: dict[str, Collection] = {}
    for name in names:
        if name == ALL:
            chosen.update(COLLECTIONS)
        elif name in COLLECTIONS:
            chosen[name] = COLLECTIONS[name]
        else:
            raise ValueError(f"unknown object type {name!r}: one of {', '.join([*COLLECTIONS, ALL])}")
    return list(chosen.values())


class Backfill:
    def __init__(self, pool: ProcessPool, api: StripeApi):
        self._pool = pool
        self._api = api

    def objects(self, collection: Collection, *, created_since: datetime | None = None,
                account: str | None = None) -> Iterator[tuple[dict, datetime]]:
        """Every object of ``collection`` with its page's fetch time, fetched page by page as consumed."""
        params = {"created": {"gte": int(created_since.timestamp())}} if created_since else {}
        for page in self._api.list(collection, params, account=account):
            for obj in page.data:
                yield obj, page.fetched_at

    def apply(self, obj: dict, fetched_at: datetime, *, account: str | None) -> bool:
        """One fetched object in its own transaction; True if it wrote anything. RowOwnedElsewhere when
        its row belongs to another account or mode."""
        livemode = obj.get("livemode")
        if not isinstance(livemode, bool):
            livemode = bool(self._api.livemode)
        try:
            with self._pool.get().connection() as conn:
                with conn.transaction():
                    return apply_object(conn, obj, fetched_at=fetched_at, account=account, livemode=livemode)
        except psycopg.errors.CheckViolation as exc:
            if exc.diag.constraint_name != ROW_OWNER:
                raise
            log.warning("fetched object refused: its row belongs to another account or mode",
                        extra={"object_id": obj.get("id"), "object": obj.get("object"), "account": account})
            raise RowOwnedElsewhere(obj.get("id")) from None

    def run(self, collections: Sequence[Collection], *, created_since: datetime | None = None,
            account: str | None = None, dry_run: bool = False,
            progress: Progress | None = None) -> list[BackfillResult]:
        results = []
        for collection in collections:
            result = BackfillResult(collection.name)
            results.append(result)
            fetched = self.objects(collection, created_since=created_since, account=account)
            with (progress(fetched, collection.name) if progress else contextlib.nullcontext(fetched)) as items:
                for obj, fetched_at in items:
                    result.fetched += 1
                    if dry_run:
                        continue
                    try:
                        written = self.apply(obj, fetched_at, account=account)
                    except RowOwnedElsewhere:
                        result.refused += 1
                        continue
                    except PermanentError as exc:
                        log.warning("fetched object not applied: it cannot be mapped",
                                    extra={"object_id": obj.get("id"), "object": obj.get("object"),
                                           "error": str(exc)[:200]})
                        result.unmappable += 1
                        continue
                    if written:
                        result.applied += 1
                    else:
                        result.kept += 1
        return results
