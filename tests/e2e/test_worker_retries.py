"""Our own retries with real worker processes: a recoverable failure completes without Stripe re-sending."""
from __future__ import annotations

import dataclasses
import time

import pytest

from devkit.factories import event
from workers.app import make_celery
from workers.wakeup import Waker
from tests.support.ledger_fixtures import BROKERS

# On Redis and on a RabbitMQ vhost of the test's own.
pytestmark = pytest.mark.parametrize("broker_settings", BROKERS, indirect=True)


def test_a_handler_failing_twice_then_succeeding_is_processed_by_real_workers_on_their_own(
        kit, broker_settings, worker_factory):
    settings = dataclasses.replace(broker_settings, retry_base_s=0.2, retry_cap_s=1.0)
    worker_factory(settings, concurrency=2)
    evt_id = kit.record(event("test.flaky", {"id": "obj_flaky", "succeed_on_attempt": 3}, created=int(time.time())))
    assert Waker(make_celery(settings)).wake(evt_id)  # the receiver's one wake-up; nothing else sends any

    row = kit.wait_status(evt_id, "processed", timeout_s=60)
    assert row["attempts"] == 3
    attempts = kit.attempts(evt_id)
    assert [a["outcome"] for a in attempts] == ["failed_recoverable", "failed_recoverable", "processed"]
    assert [a["error_class"] for a in attempts[:2]] == ["TransientError", "TransientError"]
    assert kit.effects(evt_id) == 1
    assert kit.deliveries(evt_id) == 1  # no redelivery from Stripe was needed
    assert row["failure_reason"] is None and row["last_error"] is None and row["next_attempt_at"] is None
