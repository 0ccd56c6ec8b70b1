"""Sending wake-ups: a message that says only "event X may be ready".

A failed send is never an error for the caller: the event is already durable in
Postgres, and the recovery sweep re-drives any wake-up that did not arrive.
"""
from __future__ import annotations

import logging

from celery import Celery

from workers.app import DISPATCH_EFFECT_TASK, PROCESS_EVENT_TASK

log = logging.getLogger(__name__)


class Waker:
    def __init__(self, celery: Celery):
        self._celery = celery

    def wake(self, event_id: str, *, countdown_s: float | None = None) -> bool:
        """Publish one wake-up for an event; True if the broker took it."""
        return self._send(PROCESS_EVENT_TASK, event_id, countdown_s, {"event_id": event_id})

    def wake_effect(self, outbox_id: int, *, countdown_s: float | None = None) -> bool:
        """Publish one wake-up for a recorded effect; True if the broker took it."""
        return self._send(DISPATCH_EFFECT_TASK, outbox_id, countdown_s, {"outbox_id": outbox_id})

    def _send(self, task: str, arg, countdown_s: float | None, fields: dict) -> bool:
        try:
            self._celery.send_task(task, args=[arg], countdown=countdown_s, retry=False)
            return True
        except Exception as exc:  # any broker or network failure: the sweep recovers it
            log.warning("wake-up not sent; the sweep will re-drive it",
                        extra={**fields, "error_class": type(exc).__name__})
            return False

    def ping(self) -> bool:
        """True if the broker accepts a connection now."""
        try:
            with self._celery.connection_for_write() as conn:
                conn.ensure_connection(max_retries=0, timeout=2)
            return True
        except Exception:
            return False
