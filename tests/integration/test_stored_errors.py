"""What the ledger stores about a failed attempt (last_error, each attempt's error) never quotes the payload.
(The processes' logs: tests/e2e/test_logging_payloads.py.)"""
from __future__ import annotations

import time
import uuid

from devkit.factories import event
from tests.support.workers import RecordingWaker


def test_last_error_never_quotes_a_payload_value(kit):
    marker = f"payload-marker-{uuid.uuid4().hex}"
    evt_id = kit.record(event("test.flaky", {"id": "obj_quote", "succeed_on_attempt": marker},
                              created=int(time.time())))
    kit.processor(waker=RecordingWaker()).process(evt_id)
    row = kit.event(evt_id)
    assert row["failure_reason"] == "unexpected_error"
    assert marker not in (row["last_error"] or "")
    assert all(marker not in (a["error"] or "") for a in kit.attempts(evt_id))
