"""Catch-up: the events Stripe generated that our endpoint never got, from Stripe's event list.

Stripe keeps events listable for 30 days and lists them newest first. A run lists
its range whole (``created[gte]`` the start), then records the events oldest first,
each through the receiver's own statement (``EventStore.record_delivery``, the same
dedupe: an event a webhook already delivered is a duplicate delivery, never a second
event), with ``source='catchup'``; and wakes a worker for each the delivery says needs
one, exactly as the receiver does. Business work happens in the workers, as always.
A listed event a thin notification already brought (the notification was applied under
its id, its snapshot twin: ledger.snapshot_twins) is skipped: the change is in the ledger.

The cursor (ledger.catchup_cursors, one row per account, '' the platform) is where the
last unfiltered run ended: the newest event it recorded, moved only after that event's
delivery committed. A run from the cursor lists again from ``OVERLAP`` before it, and
skips the events of that overlap the ledger already has: events of the cursor's own
second that were listed after it (Stripe's `created` has one-second resolution), or
that became listable late, are recorded, and the same events are not recorded again
every run. A run filtered by type or by ``delivery_success=false`` covers only part of
the range and leaves the cursor alone.

One run per account at a time (ledger/catchup.py): a session advisory lock, held on a connection of its
own that stays idle (no transaction) while the run calls Stripe. The second run gets
``CatchupBusy`` and does nothing. If that connection broke mid-run another run could
start; the dedupe still records nothing twice and the cursor never moves backwards.

Past 30 days nothing can be listed: a cursor whose event Stripe no longer returns, or a
``since`` older than the window, is an unrecoverable gap. The run catches up what is
still listable and reports the gap with the command that repairs the objects.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, ContextManager, Iterable, Sequence

from ledger.catchup import CatchupBusy, CatchupLedger
from ledger.config import Settings
from ledger.db import ProcessPool
from ledger.deliveries import EventStore, IncomingEvent
from ledger.stripe_events import object_and_customer
from workers import metrics
from workers.stripe_api import StripeApi

log = logging.getLogger(__name__)

WINDOW = timedelta(days=30)        # how far back Stripe lists events
OVERLAP = timedelta(minutes=5)     # listed again behind the cursor (see the module docstring)
EDGE = timedelta(minutes=1)        # a start this close to the window's edge is the whole window, not a gap
CURSOR_EVERY = 100                 # move the cursor after this many recorded events (and at the end)
EVENTS_PATH = "/v1/events"

Progress = Callable[[Sequence[dict]], ContextManager[Iterable[dict]]]


@dataclass(frozen=True)
class CatchupRequest:
    account: str | None = None           # a connected account (acct_...); None: the platform
    since: datetime | None = None        # list from here; None with from_cursor: from the cursor
    from_cursor: bool = False
    types: tuple[str, ...] = ()
    undelivered: bool = False            # only events Stripe failed to deliver (delivery_success=false)
    dry_run: bool = False

    def __post_init__(self):
        if self.from_cursor and self.since is not None:
            raise ValueError("--from-cursor and --since exclude each other")
        if self.from_cursor and (self.types or self.undelivered):
            raise ValueError("--from-cursor lists every event: it cannot be combined with --types or --undelivered")


@dataclass(frozen=True)
class Gap:
    """Events created between ``after`` and ``until`` may be lost: Stripe no longer lists them."""
    after: datetime
    until: datetime
    repair: str

    def message(self) -> str:
        return (f"unrecoverable gap: events created between {self.after.isoformat(timespec='seconds')} and "
                f"{self.until.isoformat(timespec='seconds')} are past Stripe's 30-day window and cannot be listed; "
                f"repair the objects with: {self.repair}")


@dataclass
class CatchupReport:
    account: str | None
    listed_from: datetime | None          # the created[gte] of the listing (None: the whole window)
    from_cursor: bool
    dry_run: bool
    listed: int = 0
    recorded: int = 0
    missed: int = 0                       # new to the ledger: no webhook had delivered them
    duplicates: int = 0                   # a webhook (or an earlier run) had delivered them
    skipped: int = 0                      # in the overlap behind the cursor, already in the ledger
    refused_mode: int = 0                 # of a mode LEDGER_ACCEPT_LIVEMODE refuses: not recorded, as the receiver
    woken: int = 0
    missed_by_type: dict[str, int] = field(default_factory=dict)
    cursor: dict[str, Any] | None = None  # where the cursor is after the run (None: untouched / none)
    gap: Gap | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "gap"}
        out["gap"] = None if self.gap is None else {"after": self.gap.after, "until": self.gap.until,
                                                    "repair": self.gap.repair, "message": self.gap.message()}
        return out


def repair_command(account: str | None) -> str:
    """The backfill that repairs a gap: every collection, whatever its creation date (an object created
    long before the gap may have changed inside it)."""
    return "ledgerctl backfill all" + (f" --account {account}" if account else "")


@dataclass(frozen=True)
class _Plan:
    start: datetime | None           # created[gte] of the listing; None: the whole window
    position: datetime | None        # the cursor's, before the run
    gap: Gap | None
    moves_cursor: bool


class CatchUp:
    def __init__(self, settings: Settings, pool: ProcessPool, api: StripeApi, waker, *,
                 store: EventStore | None = None):
        self._settings = settings
        self._api = api
        self._waker = waker
        self._store = store or EventStore(pool)
        self._ledger = CatchupLedger(settings, pool)

    def run(self, request: CatchupRequest, *, progress: Progress | None = None) -> CatchupReport:
        key = request.account or ""
        with contextlib.nullcontext() if request.dry_run else self._ledger.locked(key):
            return self._run(request, key, progress or contextlib.nullcontext)

    def accounts(self) -> list[str | None]:
        """The platform, then every connected account that has a cursor (what the periodic catch-up covers)."""
        return [None] + [key for key in self._ledger.accounts() if key]

    def _run(self, request: CatchupRequest, key: str, progress: Progress) -> CatchupReport:
        plan = self._plan(request, key)
        report = CatchupReport(request.account, plan.start, request.from_cursor, request.dry_run, gap=plan.gap)
        events = self._list(request, plan.start)  # no connection of ours is in a transaction meanwhile
        report.listed = len(events)
        if request.dry_run:
            known = self._ledger.known_ids([e["id"] for e in events])
            report.missed = sum(e["id"] not in known for e in events)
            report.duplicates = report.listed - report.missed
            return report
        if request.from_cursor and plan.position is not None:
            behind = self._ledger.known_ids([e["id"] for e in events if _created(e) <= plan.position])
            events = [e for e in events if e["id"] not in behind]
        brought_thin = self._ledger.snapshot_twin_ids([e["id"] for e in events])
        events = [e for e in events if e["id"] not in brought_thin]
        report.skipped = report.listed - len(events)
        self._record(events, request.account, key, report, moves_cursor=plan.moves_cursor, progress=progress)
        if plan.moves_cursor:
            self._ledger.record_run(key, found=report.missed)
            report.cursor = _plain_cursor(self._ledger.cursor(key))
        self._log(key, report)
        return report

    def _plan(self, request: CatchupRequest, key: str) -> "_Plan":
        now = datetime.now(timezone.utc)
        cursor = self._ledger.cursor(key)
        position = cursor["last_event_created"] if cursor else None
        gap = None
        if request.from_cursor:
            start = position - OVERLAP if position is not None else None
            if position is not None and self._cursor_expired(cursor, request.account, now):
                gap = Gap(position, now - WINDOW, repair_command(request.account))
        else:
            start = request.since
            if start is not None and start < now - WINDOW - EDGE:
                gap = Gap(start, now - WINDOW, repair_command(request.account))
        if start is not None and start < now - WINDOW:
            start = None  # the whole window: the API has nothing older
        # The cursor follows unfiltered runs that cover it (or that start it).
        moves_cursor = (not request.dry_run and not request.types and not request.undelivered
                        and (position is None or start is None or start <= position))
        return _Plan(start, position, gap, moves_cursor)

    def _record(self, events: list[dict], account: str | None, key: str, report: CatchupReport, *,
                moves_cursor: bool, progress: Progress) -> None:
        """Record oldest first, wake, count; the cursor follows, only ever over committed deliveries."""
        missed: collections.Counter[str] = collections.Counter()
        last = None
        try:
            with progress(events) as items:
                for n, evt in enumerate(items, start=1):
                    if not self._settings.accepts_livemode(evt.get("livemode") is True):
                        # The receiver answers such a delivery 400 and writes nothing; so does catch-up.
                        report.refused_mode += 1
                        continue
                    delivery = self._store.record_delivery(self._incoming(evt, account))
                    last = evt  # committed: record_delivery returns after COMMIT
                    report.recorded += 1
                    if delivery.inserted:
                        missed[evt["type"]] += 1
                        metrics.CATCHUP_MISSED.labels(evt["type"]).inc()
                    else:
                        report.duplicates += 1
                    if delivery.needs_wakeup and self._waker.wake(evt["id"]):
                        report.woken += 1
                    if moves_cursor and n % CURSOR_EVERY == 0:
                        self._ledger.advance(key, last["id"], _created(last))
        finally:
            report.missed = sum(missed.values())
            report.missed_by_type = dict(missed)
            if moves_cursor and last is not None:
                self._ledger.advance(key, last["id"], _created(last))

    def _log(self, key: str, report: CatchupReport) -> None:
        fields = {"account": key or "platform", "listed": report.listed, "recorded": report.recorded,
                  "missed": report.missed, "duplicates": report.duplicates, "woken": report.woken}
        if report.missed:
            log.warning("catch-up found events no webhook had delivered",
                        extra={**fields, "missed_by_type": report.missed_by_type})
        else:
            log.info("catch-up done", extra=fields)
        if report.gap is not None:
            log.error("catch-up: unrecoverable gap", extra={"account": key or "platform",
                                                            "after": report.gap.after.isoformat(),
                                                            "until": report.gap.until.isoformat(),
                                                            "repair": report.gap.repair})

    def _list(self, request: CatchupRequest, start: datetime | None) -> list[dict]:
        params: dict[str, Any] = {}
        if start is not None:
            params["created"] = {"gte": int(start.timestamp())}
        if request.types:
            params["types"] = list(request.types)
        if request.undelivered:
            params["delivery_success"] = "false"
        newest_first: dict[str, dict] = {}
        for page in self._api.pages(EVENTS_PATH, params, account=request.account):
            for evt in page.data:
                newest_first.setdefault(evt["id"], evt)
        # Oldest first: created ascending; within a second, the reverse of Stripe's order (a stable sort).
        return sorted(reversed(list(newest_first.values())), key=lambda e: int(e["created"]))

    def _cursor_expired(self, cursor: dict, account: str | None, now: datetime) -> bool:
        """Stripe's own answer where it can give one (its clock, its window): the cursor's event is gone."""
        if cursor.get("last_event_id"):
            found, _ = self._api.retrieve(EVENTS_PATH, cursor["last_event_id"], account=account)
            return found is None
        return cursor["last_event_created"] < now - WINDOW

    def _incoming(self, evt: dict, account: str | None) -> IncomingEvent:
        object_id, customer_id = object_and_customer((evt.get("data") or {}).get("object"))
        return IncomingEvent(id=evt["id"], type=evt["type"], created=int(evt["created"]),
                             livemode=bool(evt.get("livemode")), api_version=evt.get("api_version"),
                             # Listed with Stripe-Account: the event is that account's even if it does not say so.
                             account=evt.get("account") or account,
                             payload=json.dumps(evt, separators=(",", ":")), source="catchup",
                             object_id=object_id, customer_id=customer_id)


def _created(evt: dict) -> datetime:
    return datetime.fromtimestamp(int(evt["created"]), tz=timezone.utc)


def _plain_cursor(row: dict | None) -> dict | None:
    return None if row is None else {k: row[k] for k in ("last_event_id", "last_event_created", "last_run_at",
                                                        "last_found")}


class PeriodicCatchup:
    """The sweep's catch-up: every LEDGER_CATCHUP_INTERVAL_S, a run from the cursor for the platform and for
    each account with a cursor. A run another replica's sweep holds the lock for is skipped; a failed one is
    logged and tried again at the next interval. On a thread of its own, so a rate-limited run never holds
    up the sweep's re-drives."""

    def __init__(self, settings: Settings, waker, *, interval_s: float, api: StripeApi | None = None):
        self._settings = settings
        self._interval_s = interval_s
        # A small pool of its own: a long run never takes the sweep's connections.
        self._pool = ProcessPool(settings, name="catchup", max_size=2)
        self._catchup = CatchUp(settings, self._pool, api or StripeApi(settings), waker)

    def run_once(self) -> list[CatchupReport]:
        reports = []
        try:
            accounts = self._catchup.accounts()
        except Exception as exc:
            log.error("periodic catch-up: accounts not read", extra={"error_class": type(exc).__name__})
            return reports
        for account in accounts:
            try:
                reports.append(self._catchup.run(CatchupRequest(account=account, from_cursor=True)))
            except CatchupBusy:
                log.info("periodic catch-up skipped: another run holds the lock",
                         extra={"account": account or "platform"})
            except Exception as exc:  # the next interval tries again; the cursor moved only over committed events
                log.error("periodic catch-up failed", extra={"account": account or "platform",
                                                             "error_class": type(exc).__name__,
                                                             "error": str(exc)[:300]})
        return reports

    def run_until(self, stop: threading.Event) -> None:
        while True:
            self.run_once()
            if stop.wait(self._interval_s):
                return

    def close(self) -> None:
        self._pool.close()
