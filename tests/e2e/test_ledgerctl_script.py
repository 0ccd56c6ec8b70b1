"""The installed ``ledgerctl`` script in a subprocess (``run_ledgerctl``): ``main()``'s handling of a bad
configuration, the schema migrations, and output that must agree with the in-process runs (``ledgerctl_cli``)."""
from __future__ import annotations

import json
import time

import pytest

from devkit.factories import event
from ledger.config import Settings
from ledger.migrate import available_migrations
from tests.support.migrations import applied_migrations, declared_migrations
from tests.support.operator import STATS_KEYS, ledger_rows
from tests.support.workers import RecordingWaker, run_ledgerctl


# -- bad configuration -------------------------------------------------------------------------

@pytest.mark.parametrize("args", [("stats",), ("events", "show", "evt_x"), ("replay", "evt_x"), ("migrate",)])
def test_a_bad_database_url_exits_2_with_one_line_naming_the_variable(settings, args):
    done = run_ledgerctl(settings, *args, extra_env={"DATABASE_URL": "foo://x"})
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.splitlines() == [
        "error: DATABASE_URL must be a URL with scheme postgres/postgresql, got scheme 'foo'"]
    assert done.stdout == ""


def test_a_malformed_number_setting_exits_2_with_one_line(settings):
    done = run_ledgerctl(settings, "stats", extra_env={"LEDGER_MAX_ATTEMPTS": "many"})
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: LEDGER_MAX_ATTEMPTS must be an integer, got 'many'"]


# -- migrate -----------------------------------------------------------------------------------

def test_ledgerctl_migrate_check_exits_1_listing_what_is_pending_on_a_fresh_database(fresh_db):
    done = run_ledgerctl(Settings(database_url=fresh_db), "migrate", "--check")

    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == [f"pending {m.version:04d}_{m.name}" for m in available_migrations()]


def test_ledgerctl_migrate_applies_the_schema_and_check_then_exits_0(fresh_db):
    migrated = run_ledgerctl(Settings(database_url=fresh_db), "migrate")
    checked = run_ledgerctl(Settings(database_url=fresh_db), "migrate", "--check")
    again = run_ledgerctl(Settings(database_url=fresh_db), "migrate")

    assert migrated.returncode == 0, migrated.stderr
    assert f"schema up to date ({len(available_migrations())} applied)" in migrated.stdout
    assert applied_migrations(fresh_db) == declared_migrations()
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout == ""
    assert again.returncode == 0 and "schema up to date (0 applied)" in again.stdout


# -- the same answers as in-process ------------------------------------------------------------

def test_stats_as_a_table_and_from_the_installed_script_say_the_same(ledgerctl_cli, broker_settings, prepared_ledger):
    lines = ledgerctl_cli("stats").stdout.splitlines()
    words = [line.split() for line in lines]
    for status, count in prepared_ledger.by_status().items():
        assert [status, str(count)] in words
    for label, value in (("due retries", 1), ("scheduled retries", 1), ("expired leases", 1), ("in progress", 1),
                         ("queue depth", 0)):
        assert label.split() + [str(value)] in words, label
    assert any(line.startswith("oldest unprocessed") and line.rstrip().endswith("s") for line in lines)
    assert ["STATUS", "TYPE", "EVENTS"] in words
    assert ["failed_permanent", "invoice.upcoming", "2"] in words

    done = run_ledgerctl(broker_settings, "stats", "--json")
    assert done.returncode == 0, done.stderr
    from_script = json.loads(done.stdout)
    in_process = json.loads(ledgerctl_cli("stats", "--json").stdout)
    for key in STATS_KEYS - {"oldest_unprocessed_age_s"}:
        assert from_script[key] == in_process[key], key


def test_events_show_json_has_the_row_deliveries_attempts_with_errors_audit_and_business_rows(
        ledgerctl_cli, kit, broker_settings, prepared_ledger):
    rejected = prepared_ledger.groups["rejected"][0]
    kit.record(json.loads(kit.query("SELECT payload::text AS p FROM ledger.events WHERE id = %s",
                                    (rejected,))[0]["p"]))  # Stripe delivers it a second time
    ledgerctl_cli("replay", rejected, "--why", "handler fixed")
    kit.processor(waker=RecordingWaker()).process(rejected)  # still refused: a second failed attempt

    done = run_ledgerctl(broker_settings, "events", "show", rejected, "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert set(shown) == {"event", "deliveries", "attempts", "audit", "snapshot_twins", "domain_rows"}
    assert shown["event"]["id"] == rejected and shown["event"]["status"] == "failed_permanent"
    assert shown["event"]["failure_reason"] == "rejected_by_handler"
    assert "payload" not in shown["event"]
    assert shown["deliveries"]["deliveries"] == 2 == shown["event"]["deliveries"]
    assert shown["deliveries"]["first_delivered_at"] <= shown["deliveries"]["last_delivered_at"]
    assert [(a["attempt"], a["outcome"], a["error_class"]) for a in shown["attempts"]] == [
        (1, "failed_permanent", "PermanentError"), (2, "failed_permanent", "PermanentError")]
    assert all(a["error"] == "test handler refuses this event" and a["finished_at"] for a in shown["attempts"])
    assert [(a["action"], a["from_status"], a["reason"]) for a in shown["audit"]] == [
        ("replay", "failed_permanent", "handler fixed")]
    assert shown["audit"][0]["actor"] and "@" in shown["audit"][0]["actor"]
    assert shown["domain_rows"] == []

    # A subscription event: the business rows it wrote, and its transition record.
    history_ids = prepared_ledger.groups["processed"]
    sub_event = next(i for i in history_ids if prepared_ledger.rows[i][0] == "customer.subscription.deleted")
    shown = json.loads(ledgerctl_cli("events", "show", sub_event, "--json").stdout)
    sub_id = kit.query("SELECT id FROM billing.subscriptions")[0]["id"]
    assert {"table_name": "billing.subscriptions", "row_id": sub_id} in shown["domain_rows"]
    assert {"table_name": "billing.subscription_transitions",
            "row_id": f"{sub_id} active -> canceled"} in shown["domain_rows"]
    assert [(a["attempt"], a["outcome"], a["error"]) for a in shown["attempts"]] == [(1, "processed", None)]
    assert shown["audit"] == [] and shown["event"]["processed_at"]


def test_events_show_as_text_and_an_unknown_id_exits_1(ledgerctl_cli, broker_settings, prepared_ledger):
    rejected = prepared_ledger.groups["rejected"][0]
    text = ledgerctl_cli("events", "show", rejected).stdout
    assert rejected in text and "rejected_by_handler" in text and "PermanentError" in text
    assert "business rows written by this event" in text

    missing = ledgerctl_cli("events", "show", "evt_does_not_exist", "--json", code=1)
    assert missing.stdout == "" and missing.stderr.strip() == "no event evt_does_not_exist"
    done = run_ledgerctl(broker_settings, "events", "show", "evt_does_not_exist")
    assert done.returncode == 1 and done.stderr.strip() == "no event evt_does_not_exist"


def test_prune_drops_only_payloads_of_processed_events_past_retention(ledgerctl_cli, kit, broker_settings):
    now = int(time.time())
    processor = kit.processor(waker=RecordingWaker())
    aged = [kit.record(event("test.effect", {"id": f"obj_aged_{n}"}, created=now)) for n in range(3)]
    recent = kit.record(event("test.effect", {"id": "obj_recent"}, created=now))
    failed = kit.record(event("test.permanent", {"id": "obj_failed"}, created=now))
    waiting = kit.record(event("test.effect", {"id": "obj_waiting"}, created=now))
    for evt_id in [*aged, recent, failed]:
        processor.process(evt_id)
    # Processed 100 days ago; the unfinished ones were received (and failed) long ago too.
    kit.execute("UPDATE ledger.events SET processed_at = now() - interval '100 days', "
                "received_at = now() - interval '101 days' WHERE id = ANY(%s)", (aged,))
    kit.execute("UPDATE ledger.events SET received_at = now() - interval '200 days', "
                "updated_at = now() - interval '200 days' WHERE id = ANY(%s)", ([failed, waiting],))
    kit.execute("UPDATE ledger.events SET processed_at = now() - interval '89 days' WHERE id = %s", (recent,))

    before = ledger_rows(kit)
    assert json.loads(ledgerctl_cli("prune", "--older-than", "90d", "--dry-run", "--json").stdout) == {
        "would_prune": 3}
    assert "3 payload(s) would be pruned" in ledgerctl_cli("prune", "--older-than", "90d", "--dry-run").stdout
    assert json.loads(ledgerctl_cli("prune", "--older-than", "88d", "--dry-run", "--json").stdout) == {
        "would_prune": 4}
    assert ledger_rows(kit) == before

    done = run_ledgerctl(broker_settings, "prune", "--older-than", "90d", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"pruned": 3}
    payloads = {r["id"]: r["has"] for r in kit.query(
        "SELECT id, payload IS NOT NULL AS has FROM ledger.events")}
    assert payloads == {**{i: False for i in aged}, recent: True, failed: True, waiting: True}
    statuses = {i: kit.status(i) for i in [*aged, recent, failed, waiting]}
    assert statuses == {**{i: "processed" for i in aged}, recent: "processed", failed: "failed_permanent",
                        waiting: "received"}
    assert ledgerctl_cli("prune", "--older-than", "90d").stdout.strip() == "pruned 0 payload(s)"

    # A pruned event cannot be replayed, even with --force; one with its payload can.
    result = ledgerctl_cli("replay", aged[0], "--force", "--json", code=1)
    assert json.loads(result.stdout) == {"replayed": [], "skipped": [aged[0]]}
    assert kit.status(aged[0]) == "processed"
    # In bulk, the pruned ones are selected but skipped: exit 1.
    bulk = json.loads(ledgerctl_cli("replay", "--status", "processed", "--force", "--yes", "--json", code=1).stdout)
    assert bulk == {"replayed": [{"id": recent, "from_status": "processed"}], "skipped": sorted(aged)}
    assert kit.status(recent) == "received" and all(kit.status(i) == "processed" for i in aged)

    ledgerctl_cli("prune", "--older-than", "90 days", code=2)
    ledgerctl_cli("prune", code=2)
