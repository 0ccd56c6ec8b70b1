"""End-to-end fixtures: the product's real processes (devkit.stack), each killed with its process group
at teardown. Every test collected under tests/e2e carries the ``e2e`` marker.

* ``start_receiver``: the real receiver (gunicorn) on a free port.
* ``configured_worker_factory`` / ``worker_factory``: real ``celery worker`` processes.
* kit, broker_settings, ledgerctl_cli, prepared_ledger: tests/support/ledger_fixtures.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from devkit.stack import Receiver
from ledger.config import Settings
from tests.support.ledger_fixtures import (broker_settings, effects_table, kit, ledgerctl_cli,  # noqa: F401
                                           prepared_ledger)
from tests.support.receiver import drop_queue
from tests.support.workers import TEST_HANDLERS, WorkerProcess

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # Called with every item of the session, not only this folder's.
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def start_receiver(tmp_path):
    """Start the real receiver (gunicorn) as a subprocess; whatever is left is SIGKILLed after the test."""
    started: list[Receiver] = []

    def start(env, **kwargs) -> Receiver:
        receiver = Receiver(env, tmp_path, **kwargs)
        started.append(receiver)
        return receiver.start()

    yield start
    for receiver in started:
        receiver.kill()
        drop_queue(receiver.env["CELERY_BROKER_URL"], receiver.env.get("LEDGER_QUEUE") or Settings().queue_name)


@pytest.fixture
def configured_worker_factory(tmp_path):
    """Start real ``celery worker`` processes with handler modules and extra environment (METRICS_PORT, ...)
    of their own. Every worker is SIGKILLed (whole process group) at teardown."""
    started: list[WorkerProcess] = []

    def start(settings: Settings, *, handler_modules: tuple[str, ...] = (TEST_HANDLERS,),
              env: dict[str, str] | None = None, concurrency: int = 1, label: str = "w",
              ready: bool = True) -> WorkerProcess:
        worker = WorkerProcess(settings, tmp_path, concurrency=concurrency, label=label,
                               handler_modules=handler_modules, extra_env=env)
        started.append(worker)
        worker.start()
        if ready:
            worker.wait_ready()
        return worker

    yield start
    for worker in started:
        worker.kill()


@pytest.fixture
def worker_factory(configured_worker_factory):
    """Start real ``celery worker`` processes running the test handlers; every one is SIGKILLed at teardown."""
    def start(settings: Settings, *, concurrency: int = 1, label: str = "w", ready: bool = True) -> WorkerProcess:
        return configured_worker_factory(settings, concurrency=concurrency, label=label, ready=ready)

    return start
