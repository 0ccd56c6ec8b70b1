"""Handlers for test-only event types (``test.*``), loaded like any user handler module.

Load with ``load_handlers(Settings(handler_modules=("tests.support.handlers_for_tests",)))`` in-process, or
``LEDGER_HANDLER_MODULES=tests.support.handlers_for_tests`` in a worker process.

Every handler writes its business effect into ``public.test_effects``
(created by the tests, see ``ensure_test_tables``). That table has NO unique
constraint on purpose: an event applied twice shows up as two rows.

The knobs sit in the event's ``data.object``:

* ``test.effect``: insert one effect row; optional ``sleep_s`` after the insert
  (widens race windows in concurrency tests).
* ``test.flaky``: insert one effect row, then raise ``TransientError`` while
  ``ctx.attempt < succeed_on_attempt``.
* ``test.crash_before_commit``: apply the embedded billing snapshot (when the
  object carries a ``subscription``), insert one effect row, then, while
  ``ctx.attempt <= crash_attempts`` (default 1), write ``os.getpid()`` into the
  file ``marker`` names and sleep ``sleep_s``: the test SIGKILLs the process
  between the business writes and the COMMIT.
* ``test.permanent``: insert one effect row, then raise ``PermanentError``.
* ``test.lock_timeout``: insert one effect row, then ``SET LOCAL lock_timeout``
  and update the ``test_locks`` row ``lock_id`` (a test holds it locked).
* ``test.bad_row``: insert one effect row, then a row violating NOT NULL.
* ``test.statement_timeout``: insert one effect row, then
  ``SET LOCAL statement_timeout`` and ``pg_sleep`` past it.
* ``test.requires``: insert one effect row; declared ``requires=`` an id and a
  customer or customer account (an event lacking one never reaches it).

``register_pre_accounts_v2(registry)`` is not loaded by default: it stands in for
a release whose subscription handling predates Accounts v2 customers, by
registering one more ``customer.subscription.*`` handler that requires
``data.object.customer`` (tests load it onto a registry themselves).
"""
from __future__ import annotations

import dataclasses

import os
import time

import psycopg

from workers.failures import PermanentError, TransientError
from workers.registry import ApplyContext, HandlerRegistry, handler

EFFECTS_DDL = "CREATE TABLE IF NOT EXISTS public.test_effects (event_id text NOT NULL, n serial)"
LOCKS_DDL = "CREATE TABLE IF NOT EXISTS public.test_locks (id integer PRIMARY KEY, n integer NOT NULL DEFAULT 0)"


def ensure_test_tables(conn: psycopg.Connection) -> None:
    """Create (outside any apply transaction) and empty the test-only tables."""
    conn.execute(EFFECTS_DDL)
    conn.execute(LOCKS_DDL)
    # DELETE, not TRUNCATE: on a handful of rows it is many times faster.
    conn.execute("DELETE FROM public.test_effects")
    conn.execute("DELETE FROM public.test_locks")


def _effect(ctx: ApplyContext) -> None:
    ctx.conn.execute("INSERT INTO public.test_effects (event_id) VALUES (%s)", (ctx.event_id,))


@handler("test.effect")
def effect(ctx: ApplyContext) -> None:
    _effect(ctx)
    sleep_s = ctx.object.get("sleep_s")
    if sleep_s:
        time.sleep(float(sleep_s))


@handler("test.flaky")
def flaky(ctx: ApplyContext) -> None:
    _effect(ctx)  # written first, so a failed attempt must roll it back
    if ctx.attempt < int(ctx.object.get("succeed_on_attempt", 3)):
        raise TransientError(f"flaky handler fails attempt {ctx.attempt}")


@handler("test.crash_before_commit")
def crash_before_commit(ctx: ApplyContext) -> None:
    sub = ctx.object.get("subscription")
    if isinstance(sub, dict):
        # A real billing write in the same transaction, through the built-in handler.
        from workers.billing.handlers import apply_subscription

        apply_subscription(dataclasses.replace(ctx, event_type="customer.subscription.updated",
                                               event={**ctx.event, "data": {"object": sub}}))
    _effect(ctx)  # raw SQL: the rows above are written first (RowsFirst), so they are in the transaction
    if ctx.attempt <= int(ctx.object.get("crash_attempts", 1)):
        marker = ctx.object["marker"]
        tmp = f"{marker}.tmp"
        with open(tmp, "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(tmp, marker)  # the test sees the file only once the pid is in it
        time.sleep(float(ctx.object.get("sleep_s", 60)))


@handler("test.permanent")
def permanent(ctx: ApplyContext) -> None:
    _effect(ctx)
    raise PermanentError("test handler refuses this event")


@handler("test.lock_timeout")
def lock_timeout(ctx: ApplyContext) -> None:
    _effect(ctx)
    ctx.conn.execute("SET LOCAL lock_timeout = '150ms'")
    ctx.conn.execute("UPDATE public.test_locks SET n = n + 1 WHERE id = %s", (int(ctx.object["lock_id"]),))


@handler("test.statement_timeout")
def statement_timeout(ctx: ApplyContext) -> None:
    _effect(ctx)
    ctx.conn.execute("SET LOCAL statement_timeout = '150ms'")
    ctx.conn.execute("SELECT pg_sleep(5)")


@handler("test.bad_row")
def bad_row(ctx: ApplyContext) -> None:
    _effect(ctx)
    ctx.conn.execute("INSERT INTO public.test_effects (event_id) VALUES (NULL)")  # NOT NULL violation


@handler("test.requires", requires=["data.object.id", ("data.object.customer", "data.object.customer_account")])
def requires_fields(ctx: ApplyContext) -> None:
    _effect(ctx)


PRE_ACCOUNTS_V2_REQUIRES = ("data.object.customer",)


def pre_accounts_v2_subscription(ctx: ApplyContext) -> None:
    """Writes nothing: what it stands for is its requirement (the built-in handler does the writes)."""


def register_pre_accounts_v2(registry: HandlerRegistry) -> None:
    """The release before the upgrade, on ``registry``: subscriptions require ``data.object.customer``."""
    registry.register("customer.subscription.*", pre_accounts_v2_subscription, requires=PRE_ACCOUNTS_V2_REQUIRES)
