"""A handler module the replay tests deploy "after the fix" (no tests here).

A worker started without it finds no handler for ``test.replay_fixed`` but the generic mirror, which cannot keep
an object without id (object_without_id); one started with
``LEDGER_HANDLER_MODULES=tests.support.handlers_for_tests,tests.support.replay_handlers`` applies it, writing one
row into public.test_effects (no unique constraint: a second application would show as a second row).
"""
from __future__ import annotations

from workers.registry import ApplyContext, handler

FIXED_TYPE = "test.replay_fixed"
MODULE = __name__


@handler(FIXED_TYPE)
def fixed(ctx: ApplyContext) -> None:
    ctx.conn.execute("INSERT INTO public.test_effects (event_id) VALUES (%s)", (ctx.event_id,))
