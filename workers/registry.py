"""The process's handlers, found through one registry keyed by event type (glob patterns allowed).

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
point in the ``stripe_ledger.handlers`` group naming that module (or a callable
that takes the registry). A module that needs the settings to build its handlers
defines ``register_handlers(registry, settings)`` instead, as the built-in
billing module does; ``load_handlers`` calls it.

The connection is pipelined (see ``WorkerLedger.applying``): a statement's error
surfaces at the next read of a result or at COMMIT; a savepoint
(``ctx.conn.transaction()``) waits for its own statements, to catch one. A
handler never commits or rolls back ``ctx.conn``: the worker ends the transaction.
"""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from types import ModuleType

from ledger.config import Settings
from workers.handlers import ApplyContext, Handler, HandlerRegistry, declared_in, handler

# The documented import path for handler modules: ``from workers.registry import handler``.
__all__ = ["ApplyContext", "Handler", "HandlerRegistry", "handler", "load_handlers", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "stripe_ledger.handlers"
# Loaded first, by name, like any configured module: its handlers run before a user's on the same type.
BUILT_IN_MODULES = ("workers.billing.handlers",)


def load_handlers(settings: Settings | None = None) -> HandlerRegistry:
    """A new registry: the built-in handlers, then the configured modules, then entry points."""
    settings = settings or Settings()
    registry = HandlerRegistry()
    for name in (*BUILT_IN_MODULES, *settings.handler_modules):
        _add_module(registry, importlib.import_module(name), settings)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        loaded = ep.load()
        if isinstance(loaded, ModuleType):
            _add_module(registry, loaded, settings)
        elif callable(loaded):
            loaded(registry)
    return registry


def _add_module(registry: HandlerRegistry, module: ModuleType, settings: Settings) -> None:
    """A module's @handler declarations, in order; then its register_handlers(registry, settings), if any."""
    for pattern, fn in declared_in(module):
        registry.register(pattern, fn)
    register_handlers = getattr(module, "register_handlers", None)
    if callable(register_handlers):
        register_handlers(registry, settings)
