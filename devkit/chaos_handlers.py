"""Handlers the chaos run (devkit/chaos.py) loads into its workers: ``LEDGER_HANDLER_MODULES=devkit.chaos_handlers``.

* ``chaos.effect``: insert one row into ``public.chaos_effects`` (no unique
  constraint: an event applied twice shows up as two rows); with ``sleep_s`` in its
  object, then sleep that long, its transaction open (a slow handler).
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
import time

from devkit.sql import SQL
from workers.failures import TransientError
from workers.registry import ApplyContext, handler

# This module's own tables (public.*), created in each of the chaos run's databases (devkit/sql/chaos.sql).
TABLES_DDL = (SQL.chaos_effects_create, SQL.chaos_lock_create, SQL.chaos_lock_seed)
FAULT_KINDS = ("transient", "lock_timeout", "statement_timeout")


def fault_for(event_id: str, attempt: int, rate: float) -> str | None:
    """The fault injected into this attempt, if any (same answer in every process)."""
    digest = hashlib.sha256(f"{event_id}:{attempt}".encode()).digest()
    if int.from_bytes(digest[:4], "big") / 2 ** 32 >= rate:
        return None
    return FAULT_KINDS[digest[4] % len(FAULT_KINDS)]


@handler("chaos.effect")
def chaos_effect(ctx: ApplyContext) -> None:
    ctx.conn.execute(SQL.chaos_effect_record, {"event_id": ctx.event_id})
    if ctx.object.get("sleep_s"):
        time.sleep(float(ctx.object["sleep_s"]))


@handler("*")
def inject_fault(ctx: ApplyContext) -> None:
    rate = float(os.environ.get("CHAOS_FAULT_RATE") or 0)
    fault = fault_for(ctx.event_id, ctx.attempt, rate) if rate > 0 else None
    if fault == "transient":
        raise TransientError(f"chaos: injected transient fault on attempt {ctx.attempt}")
    if fault == "lock_timeout":
        ctx.conn.execute(SQL.chaos_fault_lock_timeout)
        ctx.conn.execute(SQL.chaos_lock_row)
    elif fault == "statement_timeout":
        ctx.conn.execute(SQL.chaos_fault_statement_timeout)
        ctx.conn.execute(SQL.chaos_fault_sleep)
