"""Integration fixtures: real PostgreSQL, everything else in-process (no receiver or worker processes).

* ``make_receiver_app`` / ``receiver_client``: the receiver (ingest.app.create_app) in-process.
* ``wakeup_queue``: the broker's list for ``settings.queue_name``, emptied before and after.
* ``private_postgres``: a server of the test's own, for tests that stop or break it.
* kit, broker_settings, ledgerctl_cli, prepared_ledger: tests/support/ledger_fixtures.py.
* mixed_ledger: events in every state for retention (tests/support/retention.py).
"""
from __future__ import annotations

import pytest

from devkit.servers import TEST_OPTIONS, PrivatePostgres
from ingest.app import create_app
from ledger.config import Settings
from tests.support.ledger_fixtures import (broker_settings, effects_table, kit, ledgerctl_cli,  # noqa: F401
                                           prepared_ledger)
from tests.support.retention import mixed_ledger, partitioned_kit  # noqa: F401
from tests.support.receiver import WakeupQueue, drop_queue


@pytest.fixture
def make_receiver_app():
    """Build in-process receivers (ingest.app.create_app) from Settings; their pools are closed after the test."""
    apps = []

    def make(app_settings: Settings):
        app = create_app(app_settings)
        apps.append(app)
        return app

    yield make
    for app in apps:
        ext = app.extensions["ledger"]
        ext.pool.close()
        celery_app = getattr(ext.waker, "_celery", None)
        if celery_app is not None:
            celery_app.close()
        # Wake-ups nobody consumes must not reach the next test (the sweep reads the queue depth).
        drop_queue(ext.settings.broker_url, ext.settings.queue_name)


@pytest.fixture
def receiver_client(settings, make_receiver_app):
    """A Flask test client of the receiver on the session database and the private Redis."""
    return make_receiver_app(settings).test_client()


@pytest.fixture
def wakeup_queue(settings):
    """The broker's list for settings.queue_name on the private Redis, emptied before the test."""
    queue = WakeupQueue(settings.broker_url, settings.queue_name)
    queue.clear()
    yield queue
    queue.clear()


@pytest.fixture
def private_postgres():
    """A PostgreSQL server of this test's own (the tests' options), destroyed after it."""
    server = PrivatePostgres(options=TEST_OPTIONS).init()
    server.start()
    yield server
    server.destroy()
