"""Celery tasks: thin shells that carry an id to the processor or the dispatcher.

``register_tasks`` binds them to the worker's app (workers/celery.py calls it),
so this module needs nothing from the app's module. The runtime opens its
Postgres pool lazily in whichever process first uses it (see
ledger.db.ProcessPool), so prefork children never share the parent's.

``workers.process_event`` carries one event id per message, or a list of them (the
events that a receiver process's concurrent requests recorded: Waker.wake_together). The worker runs the
ones it holds in batches (workers/batching.py: ``run_batch`` below, one
``EventProcessor.process_batch``); a wake-up with a countdown, or a call outside
a worker, runs ``process_event`` itself, one event.
"""
from __future__ import annotations

from typing import Any

from celery import Celery

from workers import batching
from workers.app import DISPATCH_EFFECT_TASK, EVENT_BATCH_MAX, PROCESS_EVENT_TASK
from workers.runtime import Runtime

IGNORED = "ignored"


def _is_event_id(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("evt_")


def register_tasks(app: Celery, runtime: Runtime) -> None:
    def process_events(wakeups: list) -> list:
        """A batch of wake-ups, each an event id or a list of them (a receiver's group: Waker.wake_together):
        one answer per message, in order, a list's being its events' outcomes (a malformed id is ignored)."""
        ids_of = [batching.event_ids(wakeup) for wakeup in wakeups]
        outcomes = iter(runtime.processor.process_batch([i for ids in ids_of for i in ids if _is_event_id(i)]))
        answers = [[next(outcomes).value if _is_event_id(i) else IGNORED for i in ids] for ids in ids_of]
        return [answer if isinstance(wakeup, list) else answer[0] for wakeup, answer in zip(wakeups, answers)]

    @app.task(name=PROCESS_EVENT_TASK, ignore_result=True, Strategy=batching.STRATEGY,
              batch_max=EVENT_BATCH_MAX, run_batch=staticmethod(process_events))
    def process_event(event_id: str | list) -> str | list:
        """The message is a pointer; the row in Postgres is the truth."""
        if isinstance(event_id, list):
            return process_events([event_id])[0]
        if not _is_event_id(event_id):
            return IGNORED
        return runtime.processor.process(event_id).value

    @app.task(name=DISPATCH_EFFECT_TASK, ignore_result=True)
    def dispatch_effect(outbox_id: int) -> str:
        """Deliver one recorded effect; the row in ledger.outbox is the truth."""
        if not isinstance(outbox_id, int) or isinstance(outbox_id, bool):
            return IGNORED
        return runtime.dispatcher.dispatch(outbox_id).value
