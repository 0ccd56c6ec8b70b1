"""Outbox metrics: counters where deliveries happen, gauges read from ledger.outbox at scrape time.
The sweep service serving them over HTTP: tests/e2e/test_metrics_endpoints.py."""
from __future__ import annotations

from prometheus_client import REGISTRY

from ledger.operator import OperatorLedger
from ledger.outbox import OutboxLedger
from tests.support.outbox_handlers import outbox_with_every_state
from workers.metrics import LedgerCollector


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_deliveries_count_sent_retries_and_failures(kit, effect_endpoint):
    before = {"sent": _sample("outbox_sent_total", effect="entitlements.changed"),
              "retry": _sample("outbox_retries_total", effect="entitlements.changed", reason="http_503"),
              "failed": _sample("outbox_failed_total", effect="invoice.payment_failed", reason="rejected_http_422")}
    outbox_with_every_state(kit, effect_endpoint())
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

    states = outbox_with_every_state(kit, effect_endpoint())
    kit.execute("UPDATE ledger.outbox SET created_at = now() - interval '90 seconds' WHERE id = %s",
                (states["pending"][0],))
    gauges = _gauges(LedgerCollector(operator, outbox))
    assert gauges["outbox_depth"] == len(states["pending"]) + len(states["failed_recoverable"]) == 8
    assert gauges["outbox_failed_permanent"] == 1
    assert gauges["outbox_oldest_unsent_age_seconds"] >= 90
    # Without an OutboxLedger the collector has no outbox gauges (and still its ledger ones).
    names = {family.name for family in LedgerCollector(operator).collect()}
    assert "ledger_events" in names and not any(n.startswith("outbox") for n in names)
