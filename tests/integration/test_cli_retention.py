"""ledgerctl retention and archive, in-process on a real ledger and a real archive directory: a run,
its status, holds, and a month listed, verified and restored; bad input exits 2 and changes nothing."""
from __future__ import annotations

import json

import pytest

from ledger.migrate import migrate
from tests.support.retention import ledger_rows


@pytest.fixture
def archive_env(tmp_path):
    return {"LEDGER_ARCHIVE_URL": str(tmp_path / "archive"), "LEDGER_RETAIN_PROCESSED_DAYS": "30",
            "LEDGER_RETAIN_FAILED_DAYS": "60"}


def test_run_status_list_verify_restore(kit, ledgerctl_cli, archive_env, mixed_ledger):
    leave = mixed_ledger["leave"]
    before = ledger_rows(kit, leave)

    run = json.loads(ledgerctl_cli("retention", "run", "--json", env=archive_env).stdout)
    assert (run["status"], run["removed"], run["kept_by_hold"]) == ("done", len(leave), 2)
    status = json.loads(ledgerctl_cli("retention", "status", "--json", env=archive_env).stdout)
    assert (status["processed_days"], status["failed_days"], len(status["holds"])) == (30, 60, 2)
    assert status["runs"][0]["removed"] == len(leave)

    [listed] = json.loads(ledgerctl_cli("archive", "list", "--json", env=archive_env).stdout)
    assert (listed["key"], listed["events"], listed["removed"]) == (run["files"][0], len(leave), len(leave))
    assert "ok" in ledgerctl_cli("archive", "verify", listed["key"], env=archive_env).stdout
    restored = ledgerctl_cli("archive", "restore", listed["key"], "--yes", env=archive_env).stdout
    assert f"{len(leave)} events restored, 0 already in the ledger" in restored
    assert ledger_rows(kit, leave) == before


def test_holds_from_the_command_line(kit, ledgerctl_cli, archive_env, mixed_ledger):
    out = ledgerctl_cli("retention", "hold", "--event", mixed_ledger["processed_old"], "--reason", "audit",
                        env=archive_env).stdout
    hold_id = out.split()[1]
    holds = json.loads(ledgerctl_cli("retention", "holds", "--json", env=archive_env).stdout)
    assert mixed_ledger["processed_old"] in [h["event_id"] for h in holds]
    ledgerctl_cli("retention", "run", env=archive_env)
    assert kit.query("SELECT 1 FROM ledger.events WHERE id = %s", (mixed_ledger["processed_old"],))
    ledgerctl_cli("retention", "release", hold_id, env=archive_env)
    ledgerctl_cli("retention", "release", hold_id, env=archive_env, code=1)


@pytest.mark.parametrize("args", [
    ("archive", "verify", "../../etc/passwd"),
    ("archive", "restore", "events/2026-01/../../x", "--yes"),
    ("retention", "hold", "--event", "cus_1", "--reason", "x"),
    ("retention", "hold", "--customer", "cus_\x00", "--reason", "x"),
    ("retention", "hold", "--event", "evt_1", "--customer", "cus_1", "--reason", "x"),
    ("retention", "hold", "--customer", "cus_1", "--reason", "   "),
    ("retention", "release", "0"),
])
def test_bad_input_exits_2_and_changes_nothing(kit, ledgerctl_cli, archive_env, args):
    ledgerctl_cli(*args, env=archive_env, code=2)
    assert kit.query("SELECT count(*) AS n FROM ledger.retention_holds")[0]["n"] == 0


def test_a_run_without_an_archive_refuses(kit, ledgerctl_cli, mixed_ledger):
    result = ledgerctl_cli("retention", "run", code=2)
    assert "LEDGER_ARCHIVE_URL is not set" in result.output
    assert kit.query("SELECT count(*) AS n FROM ledger.retention_runs")[0]["n"] == 0


def test_prune_refuses_on_a_ledger_with_an_archive(kit, ledgerctl_cli, archive_env, mixed_ledger):
    result = ledgerctl_cli("prune", "--older-than", "31d", env=archive_env, code=2)
    assert "LEDGER_ARCHIVE_URL is set" in result.output
    assert kit.query("SELECT count(*) AS n FROM ledger.events WHERE payload IS NULL")[0]["n"] == 0


def test_partitions_from_the_command_line_migrate_list_and_make_months(kit, ledgerctl_cli, fresh_db):
    assert "is not partitioned" in ledgerctl_cli("partitions").stdout
    assert "is not partitioned" in ledgerctl_cli("partitions", "ensure").stdout
    assert json.loads(ledgerctl_cli("partitions", "--json").stdout)["partitioned"] is False

    migrate(fresh_db)
    own = {"DATABASE_URL": fresh_db}
    done = json.loads(ledgerctl_cli("partitions", "migrate", "--json", env=own).stdout)
    assert done["status"] == "done"
    assert "partitioned already" in ledgerctl_cli("partitions", "migrate", env=own).stdout
    before = json.loads(ledgerctl_cli("partitions", "--json", env=own).stdout)
    assert before["partitioned"] and before["partitions"][-1]["name"] == "events_default"
    ahead = before["months_ahead"]
    made = ledgerctl_cli("partitions", "ensure", "--ahead", str(ahead + 1), env=own).stdout
    assert made.startswith("made: events_")
    assert "nothing to make" in ledgerctl_cli("partitions", "ensure", "--ahead", str(ahead + 1), env=own).stdout
    listed = ledgerctl_cli("partitions", env=own).stdout
    assert f"months ready after this one: {ahead + 1}" in listed and "events_default" in listed
    assert "Invalid value" in ledgerctl_cli("partitions", "ensure", "--ahead", "-1", code=2).stderr
    assert "nothing to abort" in ledgerctl_cli("partitions", "migrate", "--abort", code=1, env=own).stderr
