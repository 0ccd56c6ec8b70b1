"""Handlers, found through one registry keyed by event type (glob patterns allowed).

Every handler whose pattern matches an event's type runs, in registration
order, inside the same apply transaction, on the same connection: a user's
handler inherits the exactly-once guarantee of the built-in billing handlers.
An event type that no pattern matches is ``unsupported_type``.

Register your own::

    # myapp/stripe_handlers.py
    from workers.registry import handler

    @handler("invoice.paid")
    def grant_credits(ctx):
        ctx.conn.execute(
            "INSERT INTO myapp.credits (invoice_id, amount) VALUES (%s, %s)"
            " ON CONFLICT (invoice_id) DO NOTHING",   # idempotent by Stripe id
            (ctx.object["id"], ctx.object["amount_paid"]))

and load it with ``LEDGER_HANDLER_MODULES=myapp.stripe_handlers`` or an entry
point in the ``stripe_ledger.handlers`` group naming that module.

The connection is pipelined (see ``WorkerLedger.applying``): a statement's error
surfaces at the next read of a result or at COMMIT; a savepoint
(``ctx.conn.transaction()``) waits for its own statements, to catch one. A
handler never commits or rolls back ``ctx.conn``: the worker ends the transaction.
"""
from __future__ import annotations

import fnmatch
import importlib
from dataclasses import dataclass, field
from datetime import datetime
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable

import psycopg

if TYPE_CHECKING:
    from ledger.config import Settings

ENTRY_POINT_GROUP = "stripe_ledger.handlers"


@dataclass(frozen=True)
class ApplyContext:
    """What a handler gets: the event, and the connection of the apply transaction."""
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

    @property
    def object(self) -> dict[str, Any]:
        return self.event["data"]["object"]

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
        from ledger.outbox import record

        outbox_id = record(self.conn, idempotency_key=":".join(p for p in (self.event_id, effect, key) if p),
                           effect=effect, event_id=self.event_id, ordering_key=ordering_key, payload=payload)
        if outbox_id is not None:
            self.emitted.append(outbox_id)
        return outbox_id


Handler = Callable[[ApplyContext], None]


class HandlerRegistry:
    def __init__(self):
        self._entries: list[tuple[str, Handler]] = []

    def register(self, pattern: str, fn: Handler) -> Handler:
        if (pattern, fn) not in self._entries:
            self._entries.append((pattern, fn))
        return fn

    def handler(self, *patterns: str) -> Callable[[Handler], Handler]:
        def decorate(fn: Handler) -> Handler:
            for pattern in patterns:
                self.register(pattern, fn)
            return fn
        return decorate

    def resolve(self, event_type: str) -> list[Handler]:
        found: list[Handler] = []
        for pattern, fn in self._entries:
            if fnmatch.fnmatchcase(event_type, pattern) and fn not in found:
                found.append(fn)
        return found

    def patterns(self) -> list[str]:
        return [pattern for pattern, _ in self._entries]


registry = HandlerRegistry()
handler = registry.handler


def load_handlers(settings: "Settings | None" = None) -> HandlerRegistry:
    """Import the built-in handlers, the configured modules, then entry points."""
    from ledger.config import Settings

    settings = settings or Settings()
    billing = importlib.import_module("workers.billing.handlers")
    billing.configure(settings)
    for name in settings.handler_modules:
        importlib.import_module(name)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        loaded = ep.load()
        if callable(loaded):
            loaded(registry)
    return registry
