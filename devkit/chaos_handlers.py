"""Handlers the chaos run (devkit/chaos.py) loads into its workers: ``LEDGER_HANDLER_MODULES=devkit.chaos_handlers``.

* ``chaos.effect``: insert one row into ``public.chaos_effects`` (no unique
  constraint: an event applied twice shows up as two rows).
* every type (``*``, registered after the built-in billing handlers, so it runs
  after their writes in the same transaction): with probability
  ``CHAOS_FAULT_RATE`` (environment, default 0), decided by a hash of the event id
  and the attempt number (deterministic, so a run can be reasoned about), make the
  attempt fail recoverably, one of three ways:
  a ``TransientError``; a real lock timeout (SQLSTATE 55P03) on the row of
  ``public.chaos_lock`` that the harness holds locked for the whole run; a real
  statement timeout (SQLSTATE 57014).

Never load this module into a process that serves anything but a chaos run: the
``*`` pattern makes every event type "supported".
"""
from __future__ import annotations

import hashlib
import os

from workers.failures import TransientError
from workers.registry import ApplyContext, handler

TABLES_DDL = (
    "CREATE TABLE IF NOT EXISTS public.chaos_effects (event_id text NOT NULL, n bigserial)",
    "CREATE TABLE IF NOT EXISTS public.chaos_lock (id integer PRIMARY KEY)",
    "INSERT INTO public.chaos_lock (id) VALUES (1) ON CONFLICT DO NOTHING",
)
FAULT_KINDS = ("transient", "lock_timeout", "statement_timeout")


def fault_for(event_id: str, attempt: int, rate: float) -> str | None:
    """The fault injected into this attempt, if any (same answer in every process)."""
    digest = hashlib.sha256(f"{event_id}:{attempt}".encode()).digest()
    if int.from_bytes(digest[:4], "big") / 2 ** 32 >= rate:
        return None
    return FAULT_KINDS[digest[4] % len(FAULT_KINDS)]


@handler("chaos.effect")
def chaos_effect(ctx: ApplyContext) -> None:
    ctx.conn.execute("INSERT INTO public.chaos_effects (event_id) VALUES (%s)", (ctx.event_id,))


@handler("*")
def inject_fault(ctx: ApplyContext) -> None:
    rate = float(os.environ.get("CHAOS_FAULT_RATE") or 0)
    fault = fault_for(ctx.event_id, ctx.attempt, rate) if rate > 0 else None
    if fault == "transient":
        raise TransientError(f"chaos: injected transient fault on attempt {ctx.attempt}")
    if fault == "lock_timeout":
        ctx.conn.execute("SET LOCAL lock_timeout = '20ms'")
        ctx.conn.execute("SELECT id FROM public.chaos_lock WHERE id = 1 FOR UPDATE")
    elif fault == "statement_timeout":
        ctx.conn.execute("SET LOCAL statement_timeout = '20ms'")
        ctx.conn.execute("SELECT pg_sleep(1)")
