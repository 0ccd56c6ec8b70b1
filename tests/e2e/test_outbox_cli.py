"""`ledgerctl outbox list / show / replay`: JSON shapes, filters, exit codes (0 done, 1 nothing or not all, 2 usage)."""
from __future__ import annotations

import json
from datetime import datetime

import pytest

from ledger.outbox import OutboxLedger
from devkit.factories import SubscriptionHistory
from tests.support.outbox_handlers import outbox_processor, outbox_rows
from tests.support.receiver import WakeupQueue
from tests.support.workers import run_ledgerctl
from workers.dispatcher import OutboxDispatcher
from workers.effects import DeliveryFailed
from workers.retry import RetryPolicy
from workers.app import effects_queue

LIST_FIELDS = {"id", "effect", "idempotency_key", "event_id", "ordering_key", "status", "attempts", "failure_reason",
               "created_at", "sent_at"}
SHOW_FIELDS = LIST_FIELDS | {"payload", "last_error", "next_attempt_at", "lease_owner", "lease_expires_at",
                             "updated_at"}


@pytest.fixture
def outbox(kit, broker_settings):
    """One lifecycle's five effects: the first entitlements.changed sent, the invoice.payment_failed
    rejected (422, failed_permanent), the other three pending. The CLI's wake-ups go to an empty queue."""
    processor = outbox_processor(kit)
    history = SubscriptionHistory().lifecycle()
    for evt_id in kit.record_many(history.events):
        assert processor.process(evt_id) == "processed"
    rows = outbox_rows(kit)

    def send(delivery):
        if delivery.effect == "invoice.payment_failed":
            raise DeliveryFailed("HTTP 422", permanent=True, reason="rejected_http_422")

    dispatcher = OutboxDispatcher(ledger=OutboxLedger(kit.pool()),
                                  senders={"entitlements.changed": send, "invoice.payment_failed": send},
                                  policy=RetryPolicy(), waker=None, lease_s=30)
    [failed] = [r["id"] for r in rows if r["effect"] == "invoice.payment_failed"]
    sent = rows[0]["id"]
    assert dispatcher.dispatch(sent) == "sent"
    assert dispatcher.dispatch(failed) == "failed_permanent"
    # Effect wake-ups travel on the effects queue.
    queue = WakeupQueue(broker_settings.broker_url, effects_queue(broker_settings.queue_name))
    queue.clear()
    return {"rows": rows, "sent": sent, "failed": failed, "queue": queue, "settings": broker_settings,
            "pending": [r["id"] for r in rows if r["id"] not in (sent, failed)]}


def _json(result):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_list_json_is_newest_first_with_a_stable_shape_and_filters(kit, outbox):
    settings = outbox["settings"]
    listed = _json(run_ledgerctl(settings, "outbox", "list", "--json"))
    assert [r["id"] for r in listed] == sorted((r["id"] for r in outbox["rows"]), reverse=True)
    for row in listed:
        assert set(row) == LIST_FIELDS
        datetime.fromisoformat(row["created_at"])
    by_id = {r["id"]: r for r in listed}
    assert by_id[outbox["sent"]]["status"] == "sent" and by_id[outbox["sent"]]["sent_at"] is not None
    assert (by_id[outbox["failed"]]["status"], by_id[outbox["failed"]]["failure_reason"],
            by_id[outbox["failed"]]["attempts"]) == ("failed_permanent", "rejected_http_422", 1)
    assert {by_id[i]["status"] for i in outbox["pending"]} == {"pending"}

    failed = _json(run_ledgerctl(settings, "outbox", "list", "--status", "failed_permanent", "--json"))
    assert [r["id"] for r in failed] == [outbox["failed"]]
    invoices = _json(run_ledgerctl(settings, "outbox", "list", "--effect", "invoice.*", "--json"))
    assert [r["effect"] for r in invoices] == ["invoice.payment_failed"]
    assert len(_json(run_ledgerctl(settings, "outbox", "list", "--limit", "2", "--json"))) == 2

    table = run_ledgerctl(settings, "outbox", "list")
    assert table.returncode == 0
    assert table.stdout.splitlines()[0].split()[:3] == ["ID", "EFFECT", "STATUS"]
    assert all(r["idempotency_key"] in table.stdout for r in outbox["rows"])


def test_show_prints_one_effect_and_an_unknown_id_exits_1(kit, outbox):
    settings = outbox["settings"]
    shown = _json(run_ledgerctl(settings, "outbox", "show", str(outbox["failed"]), "--json"))
    assert set(shown) == SHOW_FIELDS
    row = {r["id"]: r for r in outbox["rows"]}[outbox["failed"]]
    assert shown["payload"] == row["payload"] and shown["payload"]["invoice_id"].startswith("in_")
    assert (shown["status"], shown["failure_reason"], shown["last_error"]) == \
        ("failed_permanent", "rejected_http_422", "HTTP 422")
    assert shown["idempotency_key"] == f"{row['event_id']}:invoice.payment_failed"

    human = run_ledgerctl(settings, "outbox", "show", str(outbox["failed"]))
    assert human.returncode == 0 and "rejected_http_422" in human.stdout and '"invoice_id"' in human.stdout

    missing = run_ledgerctl(settings, "outbox", "show", "987654321")
    assert missing.returncode == 1 and "no effect 987654321" in missing.stderr


USAGE_ERRORS = [
    ["outbox", "show", "abc"],
    ["outbox", "show"],
    ["outbox", "list", "--status", "bogus"],
    ["outbox", "list", "--limit", "0"],
    ["outbox", "replay"],
    ["outbox", "replay", "1", "--status", "failed_permanent"],
    ["outbox", "replay", "--status", "sent"],
    ["outbox", "replay", "--status", "pending"],
    ["outbox", "nope"],
]


def _state(kit) -> list[dict]:
    return kit.query("SELECT * FROM ledger.outbox ORDER BY id")


def test_usage_errors_exit_2_and_change_nothing(kit, outbox):
    from click.testing import CliRunner

    from ops.cli import cli

    before = _state(kit)
    # Through the installed entry point once...
    result = run_ledgerctl(outbox["settings"], "outbox", "replay", "--status", "sent")
    assert result.returncode == 2 and "needs --force" in result.stderr
    # ...and every case in-process (click decides these before touching the database).
    for args in USAGE_ERRORS:
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, (args, result.output)
    assert _state(kit) == before and len(outbox["queue"]) == 0


def test_replay_moves_failed_effects_back_to_pending_and_wakes_a_dispatcher(kit, outbox):
    settings, before = outbox["settings"], _state(kit)
    dry = _json(run_ledgerctl(settings, "outbox", "replay", "--status", "failed_permanent", "--dry-run", "--json"))
    assert dry == {"would_replay": [outbox["failed"]]}
    # No --yes and no terminal to confirm on: aborted.
    unconfirmed = run_ledgerctl(settings, "outbox", "replay", "--status", "failed_permanent")
    assert unconfirmed.returncode == 1 and "Abort" in unconfirmed.stderr
    assert _state(kit) == before and len(outbox["queue"]) == 0

    result = _json(run_ledgerctl(settings, "outbox", "replay", "--status", "failed_permanent", "--yes", "--json"))
    assert result == {"replayed": [outbox["failed"]], "skipped": []}
    [row] = outbox_rows(kit, "id = %s", (outbox["failed"],))
    assert (row["status"], row["failure_reason"], row["last_error"], row["attempts"], row["attempt_base"]) == \
        ("pending", None, None, 1, 1)
    assert outbox["queue"].messages() == [{"task": "workers.dispatch_effect", "args": [outbox["failed"]],
                                           "kwargs": {}}]

    # Nothing failed any more: the bulk replay finds nothing (exit 1).
    again = run_ledgerctl(settings, "outbox", "replay", "--status", "failed_permanent", "--yes")
    assert again.returncode == 1 and "0 replayed" in again.stdout
    # A pending and a sent effect named by id are skipped (exit 1); sent ones need --force.
    skipped = run_ledgerctl(settings, "outbox", "replay", str(outbox["pending"][0]), str(outbox["sent"]), "--json")
    assert skipped.returncode == 1
    assert json.loads(skipped.stdout) == {"replayed": [], "skipped": [outbox["pending"][0], outbox["sent"]]}
    forced = _json(run_ledgerctl(settings, "outbox", "replay", str(outbox["sent"]), "--force", "--json"))
    assert forced == {"replayed": [outbox["sent"]], "skipped": []}
    [row] = outbox_rows(kit, "id = %s", (outbox["sent"],))
    assert (row["status"], row["sent_at"]) == ("pending", None)
    assert sorted(m["args"][0] for m in outbox["queue"].messages()) == sorted([outbox["failed"], outbox["sent"]])
