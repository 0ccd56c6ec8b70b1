"""Wake-up publishing in tests: the receiver's Waker, and a broker a test stops and starts again.

Import the fixture into a test module (``from tests.support.wakeups import restartable_broker``).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from devkit.procs import free_port
from devkit.servers import PrivateRedis
from ledger.config import Settings
from workers.app import make_celery
from workers.wakeup import Waker


@contextmanager
def publisher_waker(settings: Settings) -> Iterator[Waker]:
    """The Waker the receiver builds (ingest.app.create_app: the publisher-only app); closed at the end."""
    app = make_celery(settings, publisher_only=True)
    waker = Waker(app)
    try:
        yield waker
    finally:
        waker.close()
        app.close()


class RestartableRedis:
    """A private redis-server that keeps its port across a restart (and comes back empty)."""

    def __init__(self, log_dir: Path):
        self.port = free_port()
        self._log_dir = Path(log_dir)
        self._starts = 0
        self._server: PrivateRedis | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RestartableRedis":
        self._starts += 1
        self._server = PrivateRedis(self._log_dir / f"redis-{self._starts}.log", port=self.port).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def restartable_broker(tmp_path) -> Iterator[RestartableRedis]:
    """A RestartableRedis of this test's own, started; stopped after the test."""
    broker = RestartableRedis(tmp_path).start()
    yield broker
    broker.stop()
