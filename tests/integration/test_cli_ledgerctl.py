"""ledgerctl against a real Postgres: stats, events list/show, replay exit codes, prune, bad config, --help.

Most commands run in-process through click's CliRunner (``ledgerctl_cli``, configured only through
``CliRunner(env=...)``); a few run as the installed ``ledgerctl`` script in a subprocess
(``run_ledgerctl``), which is also the only way to see ``main()``'s handling of a bad configuration.
"""
from __future__ import annotations

import fnmatch
import json
import time
from datetime import datetime, timedelta, timezone

import click
import pytest

from ledger.operator import glob_to_like
from devkit.factories import event
from tests.support.receiver import ledger_snapshot
from tests.support.workers import RecordingWaker, run_ledgerctl

STATS_KEYS = {"by_status", "by_status_and_type", "oldest_unprocessed_age_s", "due_retries", "scheduled_retries",
              "expired_leases", "in_progress", "queue_depth"}
LIST_KEYS = {"id", "type", "status", "attempts", "failure_reason", "stripe_created", "received_at", "processed_at"}


def listed(ledgerctl_cli, *args: str) -> list[dict]:
    return json.loads(ledgerctl_cli("events", "list", "--json", *args).stdout)


def ledger_rows(kit) -> dict[str, list[str]]:
    """Every row of ledger.events (payload included), attempts, deliveries and audit, as JSON text."""
    snapshot = ledger_snapshot(kit.settings.database_url)
    snapshot["audit"] = [r["j"] for r in kit.query("SELECT row_to_json(t)::text AS j FROM ledger.audit t ORDER BY id")]
    return snapshot


# -- glob_to_like ------------------------------------------------------------------------

@pytest.mark.parametrize("pattern, like", [
    (None, None),
    ("invoice.paid", "invoice.paid"),
    ("invoice.*", "invoice.%"),
    ("*.updated", "%.updated"),
    ("test.?ffect", "test._ffect"),
    ("invoice.payment_failed", "invoice.payment\\_failed"),
    ("100%", "100\\%"),
    ("a\\b", "a\\\\b"),
    ("customer.subscription.*_*", "customer.subscription.%\\_%"),
])
def test_glob_to_like_turns_glob_wildcards_into_like_ones_and_escapes_like_metacharacters(pattern, like):
    assert glob_to_like(pattern) == like


def test_glob_to_like_in_postgres_selects_exactly_what_fnmatch_selects(kit):
    types = ["invoice.paid", "invoice.payment_failed", "invoice.paymentXfailed", "invoice.payment%failed",
             "customer.subscription.updated", "customer.updated", "test.effect", "test.xffect", "test.effects",
             "entitlements.active_entitlement_summary.updated", "a\\b", "ab"]
    patterns = ["invoice.*", "invoice.payment_failed", "invoice.payment%failed", "*.updated", "customer.*",
                "test.?ffect", "*_*", "a\\b", "*", "invoice.pa?d", "%", "_"]
    for pattern in patterns:
        rows = kit.query("SELECT t FROM unnest(%s::text[]) AS t WHERE t LIKE %s", (types, glob_to_like(pattern)))
        assert {r["t"] for r in rows} == {t for t in types if fnmatch.fnmatchcase(t, pattern)}, pattern


# -- --help and bad configuration ------------------------------------------------------------

def _command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for name, command in sorted(group.commands.items()):
        paths.append(prefix + (name,))
        if isinstance(command, click.Group):
            paths.extend(_command_paths(command, prefix + (name,)))
    return paths


def test_help_of_every_command_exits_0(ledgerctl_cli):
    from ops.cli import cli

    paths = _command_paths(cli)
    assert {p[-1] for p in paths} >= {"migrate", "stats", "events", "list", "show", "replay", "sweep", "prune",
                                      "send-test-event"}
    for path in [(), *paths]:
        result = ledgerctl_cli(*path, "--help")
        assert "Usage:" in result.stdout, path
        assert ledgerctl_cli(*path, "-h").stdout == result.stdout


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


# -- stats -------------------------------------------------------------------------------------

def test_stats_json_counts_every_state_of_a_prepared_ledger(ledgerctl_cli, prepared_ledger):
    stats = json.loads(ledgerctl_cli("stats", "--json").stdout)
    assert STATS_KEYS <= set(stats)
    assert stats["by_status"] == prepared_ledger.by_status() == {
        "processed": 10, "failed_permanent": 3, "failed_recoverable": 2, "processing": 2, "received": 2}
    assert stats["by_status_and_type"] == prepared_ledger.by_status_and_type()
    assert (stats["due_retries"], stats["scheduled_retries"]) == (1, 1)
    assert (stats["expired_leases"], stats["in_progress"]) == (1, 1)
    # The oldest unfinished event was received 2 h ago (the 3-day-old ones are finished).
    assert 7200 <= stats["oldest_unprocessed_age_s"] < 3 * 3600
    assert stats["queue_depth"] == 0  # this test's own queue, nothing ever sent to it


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


def test_stats_on_an_empty_ledger(ledgerctl_cli, db):
    stats = json.loads(ledgerctl_cli("stats", "--json").stdout)
    assert stats["by_status"] == {} and stats["by_status_and_type"] == []
    assert stats["oldest_unprocessed_age_s"] is None
    assert (stats["due_retries"], stats["scheduled_retries"], stats["expired_leases"], stats["in_progress"]) == (
        0, 0, 0, 0)
    assert "oldest unprocessed   -" in ledgerctl_cli("stats").stdout


# -- events list ---------------------------------------------------------------------------------

def test_events_list_json_shape_order_and_limit(ledgerctl_cli, prepared_ledger):
    rows = listed(ledgerctl_cli)
    assert {r["id"] for r in rows} == set(prepared_ledger.rows)
    assert all(set(r) == LIST_KEYS for r in rows)
    for r in rows:
        assert (r["type"], r["status"]) == prepared_ledger.rows[r["id"]]
    received = [datetime.fromisoformat(r["received_at"]) for r in rows]
    assert received == sorted(received, reverse=True), "newest first"
    by_id = {r["id"]: r for r in rows}
    assert by_id[prepared_ledger.groups["rejected"][0]]["failure_reason"] == "rejected_by_handler"
    assert by_id[prepared_ledger.groups["processed"][1]]["processed_at"] is not None

    assert listed(ledgerctl_cli, "--limit", "3") == rows[:3]
    assert listed(ledgerctl_cli, "--limit", "1") == rows[:1]
    ledgerctl_cli("events", "list", "--limit", "0", code=2)
    ledgerctl_cli("events", "list", "--status", "done", code=2)


def test_events_list_filters_by_status_and_type_glob(ledgerctl_cli, prepared_ledger):
    ids = lambda *args: {r["id"] for r in listed(ledgerctl_cli, *args)}  # noqa: E731
    p = prepared_ledger
    for status in ("processed", "failed_permanent", "failed_recoverable", "processing", "received"):
        assert ids("--status", status) == p.ids(status=status), status
    assert ids("--type", "invoice.*") == p.ids(type_prefix="invoice.")
    assert len(p.ids(type_prefix="invoice.")) == 7
    assert ids("--type", "customer.subscription.*") == p.ids(type_prefix="customer.subscription.")
    assert ids("--type", "invoice.*", "--status", "failed_permanent") == set(p.groups["unsupported"])
    assert ids("--type", "test.?ffect") == set(p.groups["in_progress"] + p.groups["expired_lease"])
    assert ids("--type", "invoice.payment_failed") == p.ids(type_prefix="invoice.payment_failed")
    assert len(ids("--type", "invoice.payment_failed")) == 1
    assert ids("--type", "invoice.payment%") == set()  # % is not a wildcard for an operator
    assert ids("--type", "nothing.*") == set()


def test_events_list_filters_by_received_time_with_durations_and_iso_times(ledgerctl_cli, prepared_ledger):
    ids = lambda *args: {r["id"] for r in listed(ledgerctl_cli, *args)}  # noqa: E731
    everything, old, oldest = set(prepared_ledger.rows), set(prepared_ledger.groups["old"]), set(
        prepared_ledger.groups["oldest"])
    assert ids("--until", "1d") == old
    assert ids("--since", "1d") == everything - old
    assert ids("--since", "3h") == everything - old
    assert ids("--since", "1h") == everything - old - oldest
    assert ids("--since", "3h", "--until", "1h") == oldest
    assert ids("--since", "3600s", "--until", "90m") == set()

    now = datetime.now(timezone.utc)
    iso = lambda delta: (now - delta).isoformat()  # noqa: E731
    assert ids("--since", iso(timedelta(days=4)), "--until", iso(timedelta(days=2))) == old
    assert ids("--since", iso(timedelta(hours=3)), "--until", iso(timedelta(hours=1))) == oldest
    naive_utc = (now - timedelta(days=2)).replace(tzinfo=None).isoformat(timespec="seconds")
    assert ids("--until", naive_utc) == old  # a time without offset is UTC
    assert ids("--until", "2d", "--status", "failed_permanent") == set(prepared_ledger.groups["old"][1:])

    bad = ledgerctl_cli("events", "list", "--since", "yesterday", code=2)
    assert "neither an ISO time nor a duration" in bad.stderr


def test_events_list_as_a_table(ledgerctl_cli, prepared_ledger):
    lines = ledgerctl_cli("events", "list", "--status", "failed_permanent").stdout.splitlines()
    assert lines[0].split() == ["ID", "TYPE", "STATUS", "ATTEMPTS", "FAILURE_REASON", "RECEIVED_AT"]
    assert {line.split()[0] for line in lines[1:]} == prepared_ledger.ids(status="failed_permanent")
    assert all(line.split()[2] == "failed_permanent" for line in lines[1:])


# -- events show --------------------------------------------------------------------------------

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
    assert set(shown) == {"event", "deliveries", "attempts", "audit", "domain_rows"}
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


# -- replay exit codes ----------------------------------------------------------------------------

def test_replay_exit_codes(ledgerctl_cli, kit, prepared_ledger):
    p = prepared_ledger
    unsupported, rejected = p.groups["unsupported"], p.groups["rejected"][0]

    # 2: usage errors, nothing changed.
    before = ledger_rows(kit)
    for args in (("replay",), ("replay", rejected, "--status", "failed_permanent"),
                 ("replay", "--status", "processed"), ("replay", "--status", "processed", "--yes"),
                 ("replay", "--status", "received"), ("replay", rejected, "--rate", "0"),
                 ("replay", "--status", "failed_permanent", "--since", "soon")):
        result = ledgerctl_cli(*args, code=2)
        assert "Usage:" in result.stderr or "Error" in result.stderr, args
    assert ledger_rows(kit) == before

    # 0: every named event replayed.
    out = json.loads(ledgerctl_cli("replay", rejected, unsupported[0], "--why", "exit codes", "--json").stdout)
    assert out == {"replayed": [{"id": rejected, "from_status": "failed_permanent"},
                                {"id": unsupported[0], "from_status": "failed_permanent"}], "skipped": []}
    assert kit.status(rejected) == kit.status(unsupported[0]) == "received"

    # 1: some skipped (already waiting, unknown, processed without --force); the replayable one is replayed.
    processed = p.groups["processed"][2]
    result = ledgerctl_cli("replay", unsupported[1], rejected, "evt_unknown", processed, code=1)
    assert f"replayed {unsupported[1]} (was failed_permanent)" in result.stdout
    assert {line.split()[1] for line in result.stdout.splitlines() if line.startswith("skipped")} == {
        rejected, "evt_unknown", processed}
    assert "1 replayed, 3 skipped" in result.stderr
    assert kit.status(processed) == "processed"

    # 1: a bulk selection that matches nothing.
    result = ledgerctl_cli("replay", "--status", "failed_permanent", "--yes", "--json", code=1)
    assert json.loads(result.stdout) == {"replayed": [], "skipped": []}

    # A bulk replay without --yes asks; no answer means no replay (and exit 1, aborted).
    due = p.groups["due_retry"]
    before = ledger_rows(kit)
    result = ledgerctl_cli("replay", "--status", "failed_recoverable", code=1, input="")
    assert "Replay 2 event(s)?" in result.stderr and "Aborted" in result.stderr
    assert ledger_rows(kit) == before
    result = ledgerctl_cli("replay", "--status", "failed_recoverable", input="y\n")
    assert kit.status(due[0]) == "received"

    audit = kit.query("SELECT event_id, reason, from_status FROM ledger.audit ORDER BY id")
    assert [a["event_id"] for a in audit] == [rejected, unsupported[0], unsupported[1], *sorted(
        p.groups["due_retry"] + p.groups["scheduled_retry"])]
    assert audit[0]["reason"] == "exit codes" and audit[2]["reason"] is None


def test_replay_sends_one_wakeup_per_replayed_event_and_stats_sees_them_queued(ledgerctl_cli, broker_settings,
                                                                               prepared_ledger):
    from tests.support.receiver import WakeupQueue

    unsupported = prepared_ledger.groups["unsupported"]
    ledgerctl_cli("replay", *unsupported, "--rate", "1000")
    queue = WakeupQueue(broker_settings.broker_url, broker_settings.queue_name)
    assert sorted(m["args"][0] for m in queue.messages()) == sorted(unsupported)
    assert all(m["task"] == "workers.process_event" for m in queue.messages())
    assert json.loads(ledgerctl_cli("stats", "--json").stdout)["queue_depth"] == 2


# -- prune -------------------------------------------------------------------------------------

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
