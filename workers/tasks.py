"""Celery tasks: thin shells that carry an id to the processor or the dispatcher.

``register_tasks`` binds them to the worker's app (workers/celery.py calls it),
so this module needs nothing from the app's module. The runtime opens its
Postgres pool lazily in whichever process first uses it (see
ledger.db.ProcessPool), so prefork children never share the parent's.
"""
from __future__ import annotations

from celery import Celery

from workers.app import DISPATCH_EFFECT_TASK, PROCESS_EVENT_TASK
from workers.runtime import Runtime


def register_tasks(app: Celery, runtime: Runtime) -> None:
    @app.task(name=PROCESS_EVENT_TASK, ignore_result=True)
    def process_event(event_id: str) -> str:
        """The message is a pointer; the row in Postgres is the truth."""
        if not isinstance(event_id, str) or not event_id.startswith("evt_"):
            return "ignored"
        return runtime.processor.process(event_id).value

    @app.task(name=DISPATCH_EFFECT_TASK, ignore_result=True)
    def dispatch_effect(outbox_id: int) -> str:
        """Deliver one recorded effect; the row in ledger.outbox is the truth."""
        if not isinstance(outbox_id, int) or isinstance(outbox_id, bool):
            return "ignored"
        return runtime.dispatcher.dispatch(outbox_id).value
