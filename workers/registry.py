"""The process's handlers, found through one registry keyed by event type (glob patterns allowed).

Every handler whose pattern matches an event's type runs, in registration
order, inside the same apply transaction, on the same connection: a user's
handler inherits the exactly-once guarantee of the built-in billing handlers.
An event type that no pattern matches is ``unsupported_type``.

A ``v2.*`` event type (a thin event of Stripe's v2 namespace, such as
``v2.core.health.event_generation_failure.resolved``) is matched only by
patterns that start with ``v2.``: it carries no v1 object, so neither the
generic mirror ``*`` nor any other wildcard takes it. Register a v2 handler
under its own name or a ``v2.`` glob (``@handler("v2.core.health.*")``).

Register your own::

    # myapp/stripe_handlers.py
    from workers.registry import handler

    @handler("invoice.paid")
    def grant_credits(ctx):
        ctx.conn.execute(
            "INSERT INTO myapp.credits (invoice_id, amount) VALUES (%s, %s)"
            " ON CONFLICT (invoice_id) DO NOTHING",   # idempotent by Stripe id
            (ctx.object["id"], ctx.object["amount_paid"]))

    @handler("customer.subscription.*",
             requires=["data.object.id", ("data.object.customer", "data.object.customer_account")])
    def track_seats(ctx): ...

``requires`` names the fields a handler cannot do without, each a dotted path
into the event or a tuple of alternatives (any one present will do); present
means the key exists and its value is neither null nor "". Before any handler
runs, an event that lacks one ends ``failed_permanent`` / ``unmappable_payload``
with a message naming the field, the handler and the event's API version,
writing nothing: after an upgrade that reads the newer shape, ``ledgerctl
replay`` re-applies it. ``ledgerctl handlers`` lists every pattern and what it
requires.

and load it with ``LEDGER_HANDLER_MODULES=myapp.stripe_handlers`` or an entry
point in the ``stripe_ledger.handlers`` group naming that module (or a callable
that takes the registry). A module that needs the settings to build its handlers
defines ``register_handlers(registry, settings)`` instead, as the built-in
billing module does; ``load_handlers`` calls it.

The connection is pipelined (see ``WorkerLedger.applying``): a statement's error
surfaces at the next read of a result, or once the event's handlers have run; a
savepoint (``ctx.conn.transaction()``) waits for its own statements, to catch one.
A handler never commits or rolls back ``ctx.conn``: the worker ends the transaction.
"""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from types import ModuleType

from ledger.config import Settings
from workers.handlers import ApplyContext, Handler, HandlerRegistry, Requirement, declared_in, handler

# The documented import path for handler modules: ``from workers.registry import handler``.
__all__ = ["ApplyContext", "Handler", "HandlerRegistry", "Requirement", "handler", "load_handlers",
           "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "stripe_ledger.handlers"
# Loaded first, by name, like any configured module: its handlers run before a user's on the same type.
BUILT_IN_MODULES = ("workers.billing.handlers", "workers.health")


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
    """A module's @handler declarations (with what they require), in order; then its
    register_handlers(registry, settings), if any."""
    for pattern, fn, requires, rebuilt, writes in declared_in(module):
        registry.register(pattern, fn, requires, rebuilt=rebuilt, writes=writes)
    register_handlers = getattr(module, "register_handlers", None)
    if callable(register_handlers):
        register_handlers(registry, settings)
