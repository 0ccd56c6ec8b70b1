"""Handlers: what one gets (``ApplyContext``), how a module declares its own
(``@handler``), and how they are matched to an event type (``HandlerRegistry``).

No handler state lives here: ``@handler`` records a declaration in the module
that makes it, and workers.registry builds a fresh registry from the modules it
loads. How to write and load a handler module: see workers.registry.
"""
from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass, field
from datetime import datetime
from types import ModuleType
from typing import Any, Callable

import psycopg

from ledger.outbox import record


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
        outbox_id = record(self.conn, idempotency_key=":".join(p for p in (self.event_id, effect, key) if p),
                           effect=effect, event_id=self.event_id, ordering_key=ordering_key, payload=payload)
        if outbox_id is not None:
            self.emitted.append(outbox_id)
        return outbox_id


Handler = Callable[[ApplyContext], None]

# Where a module's @handler declarations are kept: in the module's own namespace.
_DECLARED = "__ledger_handlers__"


def handler(*patterns: str) -> Callable[[Handler], Handler]:
    """Declare the decorated function a handler of ``patterns`` (exact types or globs).

    The declaration is kept by the module that makes it (found as
    ``collections.namedtuple`` finds its caller), so ``handler("invoice.paid")(fn)``
    also declares a function imported from elsewhere. Nothing is registered until
    workers.registry loads the module.
    """
    declared = sys._getframe(1).f_globals.setdefault(_DECLARED, [])

    def declare(fn: Handler) -> Handler:
        declared.extend((pattern, fn) for pattern in patterns)
        return fn
    return declare


def declared_in(module: ModuleType) -> list[tuple[str, Handler]]:
    """The (pattern, handler) pairs ``module`` declared with @handler, in declaration order."""
    return list(vars(module).get(_DECLARED, ()))


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
