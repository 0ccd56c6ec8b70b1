"""Outbox metrics: counters where deliveries happen, gauges read from ledger.outbox at scrape time."""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from ledger.operator import OperatorLedger
from ledger.outbox import OutboxLedger
from devkit.factories import SubscriptionHistory
from tests.support.effect_endpoint import SECRET, free_port
from tests.support.outbox_handlers import outbox_processor, outbox_rows
from tests.support.workers import LEDGERCTL, REPO, env_for, wait_for
from workers.dispatcher import OutboxDispatcher
from workers.effects import WebhookSender
from workers.metrics import LedgerCollector
from workers.retry import RetryPolicy


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _outbox_with_every_state(kit, endpoint) -> dict[str, list[int]]:
    """Two lifecycles' effects delivered through the real sender: one sent, one failed_recoverable,
    one failed_permanent (422), the rest pending. Returns ids by state."""
    processor = outbox_processor(kit)
    for history in (SubscriptionHistory().lifecycle(), SubscriptionHistory().lifecycle()):
        for evt_id in kit.record_many(history.events):
            assert processor.process(evt_id) == "processed"
    rows = outbox_rows(kit)
    assert len(rows) == 10
    sender = WebhookSender(endpoint.url, SECRET, timeout_s=5)
    dispatcher = OutboxDispatcher(ledger=OutboxLedger(kit.pool()),
                                  senders={"entitlements.changed": sender, "invoice.payment_failed": sender},
                                  policy=RetryPolicy(base_s=60, cap_s=60, max_attempts=5), waker=None, lease_s=30)
    entitlements = [r["id"] for r in rows if r["effect"] == "entitlements.changed"]
    payment_failed = [r["id"] for r in rows if r["effect"] == "invoice.payment_failed"]
    assert dispatcher.dispatch(entitlements[0]) == "sent"
    endpoint.answer(503)
    assert dispatcher.dispatch(entitlements[1]) == "failed_recoverable"
    endpoint.reject(422)
    assert dispatcher.dispatch(payment_failed[0]) == "failed_permanent"
    endpoint.heal()
    return {"sent": entitlements[:1], "failed_recoverable": entitlements[1:2], "failed_permanent": payment_failed[:1],
            "pending": entitlements[2:] + payment_failed[1:]}


def test_deliveries_count_sent_retries_and_failures(kit, effect_endpoint):
    before = {"sent": _sample("outbox_sent_total", effect="entitlements.changed"),
              "retry": _sample("outbox_retries_total", effect="entitlements.changed", reason="http_503"),
              "failed": _sample("outbox_failed_total", effect="invoice.payment_failed", reason="rejected_http_422")}
    _outbox_with_every_state(kit, effect_endpoint())
    assert _sample("outbox_sent_total", effect="entitlements.changed") == before["sent"] + 1
    assert _sample("outbox_retries_total", effect="entitlements.changed", reason="http_503") == before["retry"] + 1
    assert _sample("outbox_failed_total", effect="invoice.payment_failed",
                   reason="rejected_http_422") == before["failed"] + 1


def _gauges(collector) -> dict[str, float]:
    return {family.name: family.samples[0].value for family in collector.collect() if len(family.samples) == 1}


def test_the_ledger_collector_reads_outbox_depth_and_failures_from_postgres(kit, effect_endpoint):
    operator, outbox = OperatorLedger(kit.pool()), OutboxLedger(kit.pool())
    empty = _gauges(LedgerCollector(operator, outbox))
    assert (empty["outbox_depth"], empty["outbox_failed_permanent"],
            empty["outbox_oldest_unsent_age_seconds"]) == (0, 0, 0.0)

    states = _outbox_with_every_state(kit, effect_endpoint())
    kit.execute("UPDATE ledger.outbox SET created_at = now() - interval '90 seconds' WHERE id = %s",
                (states["pending"][0],))
    gauges = _gauges(LedgerCollector(operator, outbox))
    assert gauges["outbox_depth"] == len(states["pending"]) + len(states["failed_recoverable"]) == 8
    assert gauges["outbox_failed_permanent"] == 1
    assert gauges["outbox_oldest_unsent_age_seconds"] >= 90
    # Without an OutboxLedger the collector has no outbox gauges (and still its ledger ones).
    names = {family.name for family in LedgerCollector(operator).collect()}
    assert "ledger_events" in names and not any(n.startswith("outbox") for n in names)


def test_the_sweep_service_serves_the_outbox_gauges(kit, broker_settings, effect_endpoint):
    _outbox_with_every_state(kit, effect_endpoint())
    port = free_port()
    env = env_for(broker_settings, extra={"METRICS_PORT": str(port), "LEDGER_SWEEP_INTERVAL_S": "0.5"})
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    sweep = subprocess.Popen([LEDGERCTL, "sweep", "--loop"], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        def scrape():
            assert sweep.poll() is None, sweep.stderr.read().decode()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                    return response.read().decode()
            except OSError:
                return None
        text = wait_for(scrape, timeout_s=60, interval_s=0.2, what="the sweep's /metrics")
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert values["outbox_depth"] == 8
        assert values["outbox_failed_permanent"] == 1
        assert values["outbox_oldest_unsent_age_seconds"] > 0
    finally:
        os.killpg(sweep.pid, signal.SIGKILL)
        sweep.wait(10)
        sweep.stderr.close()
