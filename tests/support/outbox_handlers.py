"""A handler for the outbox tests, type ``test.emit``, loaded like any user handler module.

``data.object.effects`` lists the effects to emit, each
``{"effect": name, "payload": {...}, "key": ..., "ordering_key": ..., "if_configured": bool}``
(only ``effect`` is required). With ``data.object.fail_after_emit`` the handler
raises ``TransientError`` after emitting, so the apply transaction (and the
recorded effects with it) must roll back.
"""
from __future__ import annotations

from tests.support.workers import RecordingWaker
from workers.failures import TransientError
from workers.registry import ApplyContext, handler

MODULE = __name__


@handler("test.emit")
def emit(ctx: ApplyContext) -> None:
    for spec in ctx.object.get("effects", []):
        ctx.emit(spec["effect"], spec.get("payload", {}), key=spec.get("key"),
                 ordering_key=spec.get("ordering_key"), if_configured=bool(spec.get("if_configured")))
    if ctx.object.get("fail_after_emit") and ctx.attempt <= int(ctx.object.get("fail_attempts", 1)):
        raise TransientError(f"failing after emit on attempt {ctx.attempt}")


# -- helpers shared by the outbox tests ----------------------------------------------------------

# Where each lifecycle event (devkit.factories.SubscriptionHistory.lifecycle) changes the customer's
# entitlements when the events are applied in order: trialing grants the price's features,
# past_due revokes them, active again grants them, canceled revokes them.
LIFECYCLE_ENTITLEMENT_CHANGES = (1, 5, 7, 9)
LIFECYCLE_PAYMENT_FAILED = (4,)


def lifecycle_expected_keys(history, upto: int | None = None) -> set[str]:
    """The idempotency keys applying ``history.events[:upto]`` in order must record, from the lifecycle alone."""
    events = history.events[:upto]
    keys = set()
    for index, evt in enumerate(events):
        if index in LIFECYCLE_ENTITLEMENT_CHANGES:
            keys.add(f"{evt['id']}:entitlements.changed:{history.customer_id}")
        if index in LIFECYCLE_PAYMENT_FAILED:
            assert evt["type"] == "invoice.payment_failed"
            keys.add(f"{evt['id']}:invoice.payment_failed")
    return keys


class EffectWaker(RecordingWaker):
    """A Waker stand-in for in-process tests: remembers event and effect wake-ups (no broker)."""

    def __init__(self):
        super().__init__()
        self.effects: list[tuple[int, float | None]] = []

    def wake_effect(self, outbox_id: int, *, countdown_s: float | None = None) -> bool:
        self.effects.append((outbox_id, countdown_s))
        return True

    @property
    def effect_ids(self) -> list[int]:
        return [outbox_id for outbox_id, _ in self.effects]


def outbox_processor(kit, *, effects=("entitlements.changed", "invoice.payment_failed"), waker=None,
                     settings=None, modules=(MODULE,), name: str = "test"):
    """An in-process EventProcessor with senders 'configured' for ``effects`` (what enables if_configured emits)."""
    import dataclasses

    from ledger.attempts import WorkerLedger
    from workers.processor import EventProcessor
    from workers.registry import load_handlers

    settings = dataclasses.replace(settings or kit.settings, handler_modules=tuple(modules))
    return EventProcessor.from_settings(settings, WorkerLedger(kit.pool(name, settings)), load_handlers(settings),
                                        waker, enabled_effects=frozenset(effects))


def outbox_rows(kit, where: str = "TRUE", params=None) -> list[dict]:
    return kit.query(f"SELECT *, now() AS db_now FROM ledger.outbox WHERE {where} ORDER BY id", params)


def customer_features(kit, customer_id: str) -> list[str]:
    """The features billing.entitlements grants a customer now."""
    return sorted(r["feature"] for r in kit.query(
        "SELECT DISTINCT feature FROM billing.entitlements WHERE customer_id = %s", (customer_id,)))


def outbox_with_every_state(kit, endpoint) -> dict[str, list[int]]:
    """Two lifecycles' effects delivered through the real sender: one sent, one failed_recoverable,
    one failed_permanent (422), the rest pending. Returns ids by state."""
    from devkit.factories import SubscriptionHistory
    from ledger.outbox import OutboxLedger
    from tests.support.effect_endpoint import SECRET
    from workers.dispatcher import OutboxDispatcher
    from workers.effects import WebhookSender
    from workers.retry import RetryPolicy

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
