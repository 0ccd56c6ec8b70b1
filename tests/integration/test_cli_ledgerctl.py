"""ledgerctl in-process against a real Postgres: stats, events list, replay exit codes and wake-ups, --help.

Every command runs through click's CliRunner (``ledgerctl_cli``, configured only through ``CliRunner(env=...)``).
The installed ``ledgerctl`` script, and ``main()``'s handling of a bad configuration, are tested in
tests/e2e/test_ledgerctl_script.py.
"""
from __future__ import annotations

import fnmatch
import json
from datetime import datetime, timedelta, timezone

import click

from ledger.event_query import glob_to_like
from tests.support.operator import STATS_KEYS, ledger_rows
from tests.support.receiver import WakeupQueue

LIST_KEYS = {"id", "type", "status", "attempts", "failure_reason", "account", "livemode", "stripe_created", "received_at",
             "processed_at"}


def listed(ledgerctl_cli, *args: str) -> list[dict]:
    return json.loads(ledgerctl_cli("events", "list", "--json", *args).stdout)


# -- glob_to_like ------------------------------------------------------------------------

def test_glob_to_like_in_postgres_selects_exactly_what_fnmatch_selects(kit):
    types = ["invoice.paid", "invoice.payment_failed", "invoice.paymentXfailed", "invoice.payment%failed",
             "customer.subscription.updated", "customer.updated", "test.effect", "test.xffect", "test.effects",
             "entitlements.active_entitlement_summary.updated", "a\\b", "ab"]
    patterns = ["invoice.*", "invoice.payment_failed", "invoice.payment%failed", "*.updated", "customer.*",
                "test.?ffect", "*_*", "a\\b", "*", "invoice.pa?d", "%", "_"]
    for pattern in patterns:
        rows = kit.query("SELECT t FROM unnest(%s::text[]) AS t WHERE t LIKE %s", (types, glob_to_like(pattern)))
        assert {r["t"] for r in rows} == {t for t in types if fnmatch.fnmatchcase(t, pattern)}, pattern


# -- --help ------------------------------------------------------------------------------------

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
    assert "'yesterday' is a time like 2026-12-01T10:00" in bad.stderr and "or a duration like 24h" in bad.stderr


def test_events_list_as_a_table(ledgerctl_cli, prepared_ledger):
    lines = ledgerctl_cli("events", "list", "--status", "failed_permanent").stdout.splitlines()
    assert lines[0].split() == ["ID", "TYPE", "STATUS", "ATTEMPTS", "FAILURE_REASON", "RECEIVED_AT"]
    assert {line.split()[0] for line in lines[1:]} == prepared_ledger.ids(status="failed_permanent")
    assert all(line.split()[2] == "failed_permanent" for line in lines[1:])


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
    unsupported = prepared_ledger.groups["unsupported"]
    ledgerctl_cli("replay", *unsupported, "--rate", "1000")
    queue = WakeupQueue(broker_settings.broker_url, broker_settings.queue_name)
    assert sorted(m["args"][0] for m in queue.messages()) == sorted(unsupported)
    assert all(m["task"] == "workers.process_event" for m in queue.messages())
    assert json.loads(ledgerctl_cli("stats", "--json").stdout)["queue_depth"] == 2



def test_send_test_event_refuses_a_file_the_receiver_would_refuse_and_sends_nothing(ledgerctl_cli, tmp_path):
    not_an_event = tmp_path / "note.json"
    not_an_event.write_text(json.dumps({"object": "v2.core.event", "id": "evt_1", "type": "v1.customer.updated"}))
    # Nothing listens on the URL: a file that got past the check would fail to connect (exit 1), not exit 2.
    result = ledgerctl_cli("send-test-event", "--url", "http://127.0.0.1:9/webhooks/stripe", "--file",
                           str(not_an_event), code=2, env={"STRIPE_WEBHOOK_SECRET": "whsec_test"})
    assert "is not a snapshot event the receiver records" in result.output
    assert "thin event notification" in result.output or "/webhooks/stripe/thin" in result.output
