"""Celery tasks: thin shells that carry an event id to the processor.

The runtime opens its Postgres pool lazily in whichever process first uses it
(see ledger.db.ProcessPool), so prefork children never share the parent's.
"""
from __future__ import annotations

from celery import shared_task

from workers.app import DISPATCH_EFFECT_TASK, PROCESS_EVENT_TASK
from workers.celery import app, settings
from workers.runtime import Runtime

runtime = Runtime(settings, app)


@shared_task(name=PROCESS_EVENT_TASK, ignore_result=True)
def process_event(event_id: str) -> str:
    """The message is a pointer; the row in Postgres is the truth."""
    if not isinstance(event_id, str) or not event_id.startswith("evt_"):
        return "ignored"
    return runtime.processor.process(event_id).value


@shared_task(name=DISPATCH_EFFECT_TASK, ignore_result=True)
def dispatch_effect(outbox_id: int) -> str:
    """Deliver one recorded effect; the row in ledger.outbox is the truth."""
    if not isinstance(outbox_id, int) or isinstance(outbox_id, bool):
        return "ignored"
    return runtime.dispatcher.dispatch(outbox_id)
