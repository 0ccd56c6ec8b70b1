"""Handlers for the model-based ledger test (tests/integration/test_model_ledger.py), type ``model.effect``.

The handler writes one row into ``public.test_effects`` (no unique constraint: an
event applied twice shows up as two rows), then looks up a fault armed for the
event in ``FAULTS`` and, if one is, consumes it and fails the attempt after the
write, so a failed attempt must roll its write back:

* ``"transient"``: raise ``TransientError`` (recoverable);
* ``"permanent"``: raise ``PermanentError`` (reason ``rejected_by_handler``).

``FAULTS`` is process-local: the model test runs every attempt in-process.
"""
from __future__ import annotations

import threading

from workers.failures import PermanentError, TransientError
from workers.registry import ApplyContext, handler

FAULTS: dict[str, str] = {}
_lock = threading.Lock()


def arm(event_id: str, kind: str) -> None:
    """Fail the next attempt of ``event_id`` that reaches the handler (``transient`` or ``permanent``)."""
    assert kind in ("transient", "permanent"), kind
    with _lock:
        FAULTS[event_id] = kind


def disarm_all() -> None:
    with _lock:
        FAULTS.clear()


@handler("model.effect")
def model_effect(ctx: ApplyContext) -> None:
    ctx.conn.execute("INSERT INTO public.test_effects (event_id) VALUES (%s)", (ctx.event_id,))
    with _lock:
        fault = FAULTS.pop(ctx.event_id, None)
    if fault == "transient":
        raise TransientError(f"injected transient fault on attempt {ctx.attempt}")
    if fault == "permanent":
        raise PermanentError(f"injected permanent fault on attempt {ctx.attempt}")
