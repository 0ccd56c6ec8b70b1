"""Per-process wiring for workers and the sweep, built on first use (after fork)."""
from __future__ import annotations

from functools import cached_property

from celery import Celery

from ledger.config import Settings
from ledger.db import ProcessPool
from ledger.store import WorkerLedger
from workers.processor import EventProcessor
from workers.registry import load_handlers
from workers.sweep import Sweeper
from workers.wakeup import Waker


class Runtime:
    def __init__(self, settings: Settings, celery: Celery):
        self.settings = settings
        self.celery = celery

    @cached_property
    def pool(self) -> ProcessPool:
        return ProcessPool(self.settings, name="worker")

    @cached_property
    def ledger(self) -> WorkerLedger:
        return WorkerLedger(self.pool)

    @cached_property
    def waker(self) -> Waker:
        return Waker(self.celery)

    @cached_property
    def processor(self) -> EventProcessor:
        registry = load_handlers(self.settings)
        return EventProcessor.from_settings(self.settings, self.ledger, registry, self.waker)

    @cached_property
    def sweeper(self) -> Sweeper:
        return Sweeper(self.ledger, self.waker, self.celery, self.settings)
