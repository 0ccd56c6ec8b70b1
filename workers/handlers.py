"""Handlers: what one gets (``ApplyContext``), how a module declares its own
(``@handler``), the fields each requires, and how they are matched to an event
type (``HandlerRegistry``).

No handler state lives here: ``@handler`` records a declaration in the module
that makes it, and workers.registry builds a fresh registry from the modules it
loads. How to write and load a handler module: see workers.registry.
"""
from __future__ import annotations

import fnmatch
import functools
import logging
import sys
from dataclasses import dataclass, field
from datetime import datetime
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Union

import psycopg

from ledger.outbox import record
from ledger.stripe_events import is_v2
from workers.failures import UnmappablePayload
from workers.rows import EventRows, Table


# Fields of an event's object naming other objects whose rows its handlers write.
_RELATED_OBJECTS = ("customer", "customer_account", "subscription")


def object_keys(event: Mapping[str, Any]) -> set[str]:
    """The Stripe ids of the business objects applying ``event`` may write: its object's, and its
    customer's and subscription's (an expanded one by its id). The apply transaction locks them
    before any write (ledger/sql/objects.sql); a handler writing a row keyed by anything else
    is left to Postgres' deadlock detection."""
    data = event.get("data")
    obj = data.get("object") if isinstance(data, dict) else None
    if not isinstance(obj, dict):
        return set()
    keys = set()
    for value in (obj.get("id"), *(obj.get(name) for name in _RELATED_OBJECTS)):
        if isinstance(value, dict):
            value = value.get("id")
        if isinstance(value, str) and value:
            keys.add(value)
    return keys


class RowsFirst:
    """The apply transaction's connection as a handler sees it (``ctx.conn``): any use of it first writes
    the rows the batch's handlers recorded so far (``ctx.rows``), so raw SQL finds its own event's rows
    written, and what it writes comes after them. A handler that writes only through ``ctx.rows`` never
    touches it, and its batch is written in one go."""

    __slots__ = ("raw", "_rows")

    def __init__(self, raw: Any, rows: EventRows):
        self.raw = raw
        self._rows = rows

    def __getattr__(self, name: str) -> Any:
        self._rows.flush()
        return getattr(self.raw, name)


@dataclass(frozen=True)
class ApplyContext:
    """What a handler gets: the event, where its rows go (``rows``), and the apply transaction's
    connection (``conn``, for raw SQL: see RowsFirst).

    ``event_id`` is the change's id, what rows and effects are keyed by: the event's own, or for a
    thin notification that Stripe says is the thin version of a snapshot event, that snapshot
    event's id, so both payload styles of one change write the same keys (``ledger_event_id`` is
    then the notification's, the ledger row the attempt belongs to)."""
    conn: psycopg.Connection
    event_id: str
    event_type: str
    created: datetime
    livemode: bool
    account: str | None
    event: dict[str, Any]
    attempt: int
    # Effects a sender is configured for; ids of the effects this attempt recorded.
    enabled_effects: frozenset[str] = frozenset()
    emitted: list[int] = field(default_factory=list)
    ledger_event_id: str | None = None  # None: event_id
    # What handlers asked to run once this attempt's writes are committed (see on_commit).
    _after_commit: list[Callable[[], None]] = field(default_factory=list, repr=False)
    # This event's door to the batch's writer (workers/rows.py): what handlers write their rows through.
    rows: EventRows | None = None

    def __post_init__(self):
        raw = self.conn.raw if isinstance(self.conn, RowsFirst) else self.conn
        object.__setattr__(self, "_raw", raw)
        if self.rows is not None:
            object.__setattr__(self, "conn", RowsFirst(raw, self.rows))

    @property
    def object(self) -> dict[str, Any]:
        return self.event["data"]["object"]

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` after this attempt's transaction commits (a log line, a metric), never if it rolls back.
        It runs in the worker once; an exception it raises is logged and does not undo the commit."""
        self._after_commit.append(fn)

    def run_after_commit(self) -> None:
        """The worker's, after COMMIT: every ``on_commit`` function, in order."""
        for fn in self._after_commit:
            try:
                fn()
            except Exception:  # noqa: BLE001 - the attempt committed: nothing of it can be undone now
                logging.getLogger(__name__).exception("a handler's after-commit function failed",
                                                      extra={"event_id": self.event_id})

    def emit(self, effect: str, payload: dict[str, Any], *, key: str | None = None,
             ordering_key: str | None = None, if_configured: bool = False) -> int | None:
        """Record an external effect in this transaction; it is delivered after COMMIT, at least once.

        Its idempotency key is ``<event id>:<effect>[:<key>]``: re-applying the
        event records nothing new. Effects with the same ``ordering_key`` (a
        customer id) carry increasing sequence numbers in commit order.
        ``if_configured`` skips the effect when no sender is configured for it.
        """
        if if_configured and effect not in self.enabled_effects:
            return None
        if self.rows is not None:
            # What the batch recorded so far is written first, its objects locked: an effect is never
            # recorded in a transaction that would not apply its event (a batch defers an event whose
            # objects another transaction holds).
            self.rows.flush()
        outbox_id = record(self._raw, idempotency_key=":".join(p for p in (self.event_id, effect, key) if p),
                           effect=effect, event_id=self.ledger_event_id or self.event_id,
                           ordering_key=ordering_key, payload=payload)
        if outbox_id is not None:
            self.emitted.append(outbox_id)
        return outbox_id


Handler = Callable[[ApplyContext], None]

# A dotted path into the event ("data.object.customer"), or a tuple of alternative paths: any one present meets it.
Requirement = Union[str, tuple[str, ...]]


class Registration(NamedTuple):
    """One pattern of one handler, and what the handler requires of an event it takes; ``rebuilt``: a
    re-projection runs it (it writes only through ``ctx.rows``, the tables ``writes`` names)."""
    pattern: str
    handler: Handler
    requires: tuple[Requirement, ...] = ()
    rebuilt: bool = False
    writes: tuple[Table, ...] = ()


# Where a module's @handler declarations are kept: in the module's own namespace.
_DECLARED = "__ledger_handlers__"


def alternatives(requirement: Requirement) -> tuple[str, ...]:
    """The paths of a requirement, checked: each one a dotted path of non-empty keys."""
    try:
        return _alternatives(tuple(requirement) if isinstance(requirement, list) else requirement)
    except TypeError:  # unhashable: a path that is not a string
        raise ValueError(f"a requirement is a dotted path or a tuple of them, not {requirement!r}") from None


@functools.lru_cache(maxsize=1024)  # checked once per requirement: every event asks for its handlers' again
def _alternatives(requirement: Requirement) -> tuple[str, ...]:
    paths = (requirement,) if isinstance(requirement, str) else (
        tuple(requirement) if isinstance(requirement, (tuple, list)) else ())
    if not paths or not all(isinstance(p, str) and p and all(p.split(".")) for p in paths):
        raise ValueError(f"a requirement is a dotted path or a tuple of them, not {requirement!r}")
    return paths


def describe(requirement: Requirement) -> str:
    """How messages and listings name a requirement: its paths joined by " or "."""
    return " or ".join(alternatives(requirement))


def value_at(data: Any, path: str) -> Any:
    """The value at a dotted path (each key into a mapping), or None where the path does not lead."""
    for key in _keys(path):
        if not isinstance(data, dict):  # parsed JSON: a dict, never another Mapping
            return None
        data = data.get(key)
    return data


@functools.lru_cache(maxsize=1024)
def _keys(path: str) -> tuple[str, ...]:
    return tuple(path.split("."))


def is_present(data: Any, path: str) -> bool:
    """Present: every key of the path exists and the value is neither None nor "". Stripe sends a field a
    version does not fill as null, so null counts as absent; an empty list or object is a value."""
    value = value_at(data, path)
    return value is not None and value != ""


def handler_name(fn: Handler) -> str:
    """A handler's name: a function's, or the class of a callable instance (SubscriptionHandler)."""
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def handler(*patterns: str, requires: Iterable[Requirement] = (), rebuilt: bool = False,
            writes: Iterable[Table] = ()) -> Callable[[Handler], Handler]:
    """Declare the decorated function a handler of ``patterns`` (exact types or globs) that needs ``requires``.

    ``rebuilt``: ``ledgerctl reproject`` runs it too, and rebuilds the tables it ``writes`` (each a
    workers.rows.Table of schema billing) beside billing's own; such a handler writes only through
    ``ctx.rows``. The declaration is kept by the module that makes it (found as
    ``collections.namedtuple`` finds its caller), so ``handler("invoice.paid")(fn)``
    also declares a function imported from elsewhere. Nothing is registered until
    workers.registry loads the module.
    """
    declared = sys._getframe(1).f_globals.setdefault(_DECLARED, [])
    needed = _requirements(requires)
    tables = _tables(writes, rebuilt)

    def declare(fn: Handler) -> Handler:
        declared.extend(Registration(pattern, fn, needed, rebuilt, tables) for pattern in patterns)
        return fn
    return declare


def _tables(writes: Iterable[Table], rebuilt: bool) -> tuple[Table, ...]:
    tables = tuple(writes)
    if any(not isinstance(t, Table) for t in tables):
        raise TypeError("writes names workers.rows.Table declarations")
    if rebuilt and any(t.schema != "billing" for t in tables):
        raise ValueError("a rebuilt handler's tables live in schema billing, where a rebuild makes their shadows: "
                         + ", ".join(t.name for t in tables if t.schema != "billing"))
    return tables


def declared_in(module: ModuleType) -> list[Registration]:
    """What ``module`` declared with @handler, in declaration order."""
    return list(vars(module).get(_DECLARED, ()))


def _requirements(requires: Iterable[Requirement]) -> tuple[Requirement, ...]:
    if isinstance(requires, str):
        raise TypeError("requires is a list of requirements: requires=[\"data.object.id\"], not a bare path")
    needed = []
    for requirement in requires:
        paths = alternatives(requirement)  # a malformed one is refused when declared, not at the first event
        needed.append(requirement if isinstance(requirement, str) else paths)
    return tuple(needed)


def _matches(event_type: str, pattern: str) -> bool:
    # A v2 event (thin, e.g. v2.core.health.*) carries no v1 object: only patterns of its own namespace take it.
    if is_v2(event_type) and not is_v2(pattern):
        return False  # neither "*" nor any other wildcard takes a v2 event (workers.registry)
    return fnmatch.fnmatchcase(event_type, pattern)


class HandlerRegistry:
    def __init__(self):
        self._entries: list[Registration] = []
        # requirements() by event type: matching every pattern (fnmatch) cost a worker or a rebuild more per
        # event than some of the handlers' statements. Emptied by every register().
        self._by_type: dict[str, list[tuple[Handler, tuple[Requirement, ...]]]] = {}

    def register(self, pattern: str, fn: Handler, requires: Iterable[Requirement] = (), *, rebuilt: bool = False,
                 writes: Iterable[Table] = ()) -> Handler:
        """Add ``fn`` for ``pattern``. The same pair registered again keeps one entry, which gains the
        requirements and tables it did not have (and is rebuilt if either registration says so)."""
        needed = _requirements(requires)
        tables = _tables(writes, rebuilt)
        self._by_type.clear()
        for index, entry in enumerate(self._entries):
            if entry.pattern == pattern and entry.handler == fn:
                added = tuple(r for r in needed if r not in entry.requires)
                self._entries[index] = entry._replace(
                    requires=entry.requires + added, rebuilt=entry.rebuilt or rebuilt,
                    writes=entry.writes + tuple(t for t in tables if t not in entry.writes))
                return fn
        self._entries.append(Registration(pattern, fn, needed, rebuilt, tables))
        return fn

    def handler(self, *patterns: str, requires: Iterable[Requirement] = (), rebuilt: bool = False,
                writes: Iterable[Table] = ()) -> Callable[[Handler], Handler]:
        needed = _requirements(requires)

        def decorate(fn: Handler) -> Handler:
            for pattern in patterns:
                self.register(pattern, fn, needed, rebuilt=rebuilt, writes=writes)
            return fn
        return decorate

    def is_rebuilt(self, fn: Handler) -> bool:
        """Whether any registration of ``fn`` declares it rebuilt."""
        return any(entry.rebuilt for entry in self._entries if entry.handler == fn)

    def tables_written(self) -> list[Table]:
        """The tables the registrations say they write, once each, in order."""
        seen: list[Table] = []
        for entry in self._entries:
            seen.extend(t for t in entry.writes if t not in seen)
        return seen

    def resolve(self, event_type: str) -> list[Handler]:
        """Every handler one of whose patterns matches, once each, in registration order."""
        return [fn for fn, _ in self.requirements(event_type)]

    def apply(self, context: ApplyContext) -> None:
        """Every handler of the context's event type, in order: what a worker's attempt and a rebuild
        (workers/reproject.py) both run, once ``check_required`` has passed."""
        for handle in self.resolve(context.event_type):
            handle(context)

    def requirements(self, event_type: str) -> list[tuple[Handler, tuple[Requirement, ...]]]:
        """The handlers ``resolve`` returns, each with what it requires of an event of this type
        (the requirements of every pattern through which it matches)."""
        found = self._by_type.get(event_type)
        if found is None:
            found = self._by_type[event_type] = self._match(event_type)
        return list(found)

    def _match(self, event_type: str) -> list[tuple[Handler, tuple[Requirement, ...]]]:
        order: list[tuple[Handler, list[Requirement]]] = []
        for pattern, fn, requires, *_ in self._entries:
            if not _matches(event_type, pattern):
                continue
            slot = next((s for s in order if s[0] == fn), None)
            if slot is None:
                slot = (fn, [])
                order.append(slot)
            slot[1].extend(r for r in requires if r not in slot[1])
        return [(fn, tuple(requires)) for fn, requires in order]

    def check_required(self, event_type: str, event: Mapping[str, Any], api_version: str | None) -> None:
        """Raise UnmappablePayload for the first requirement, of the handlers in order, that ``event`` does
        not meet (see ``is_present``); before any handler runs, so a refused event writes nothing."""
        for fn, requires in self.requirements(event_type):
            for requirement in requires:
                if not any(is_present(event, path) for path in alternatives(requirement)):
                    raise UnmappablePayload(
                        describe(requirement),
                        f"is missing: {handler_name(fn)} requires it (event at API version "
                        f"{api_version or 'unknown'}); a replay after an upgrade re-applies it")

    def entries(self) -> list[Registration]:
        """Every registration, in order (what ``ledgerctl handlers`` lists)."""
        return list(self._entries)

    def patterns(self) -> list[str]:
        return [entry.pattern for entry in self._entries]
