"""Retention on real Postgres and a real archive directory: what leaves, what stays, and that what
left comes back exactly (docs/retention.md). The S3 store, over HTTP against a moto server process,
is tests/integration/test_retention_s3.py.
"""
from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from ledger.archive import DirectoryStore, read_lines
from ledger.errors import ConfigError
from ledger.partitions import Partitions
from ledger.retention import Retention, RetentionPolicy
from tests.support.retention import build_mixed_ledger, ledger_rows
from tests.support.workers import RecordingWaker


@pytest.fixture
def store(tmp_path):
    return DirectoryStore(tmp_path / "archive")


@pytest.fixture
def retention(kit, settings, store):
    def make(*, policy: RetentionPolicy = RetentionPolicy(processed_days=30, failed_days=60), **kwargs):
        return Retention(kit.pool("retention"), store, policy, **kwargs)
    return make


def test_retention_archives_then_removes_only_final_unheld_events_past_their_window(kit, retention, store,
                                                                                    mixed_ledger):
    runner = retention()
    everything = {v for v in mixed_ledger.values() if isinstance(v, str)}

    report = runner.run()

    assert report.status == "done", report.error
    remaining = {r["id"] for r in kit.query("SELECT id FROM ledger.events")}
    assert remaining == everything - mixed_ledger["leave"]
    assert (report.archived, report.removed, report.changed, report.kept_by_hold) == (4, 4, 0, 2)
    archived = {json.loads(line)["event"]["id"] for key in report.files for line in read_lines(_local(store, key))}
    assert archived == mixed_ledger["leave"]
    [run] = runner.recent_runs()
    assert (run["status"], run["archived"], run["removed"], run["kept_by_hold"], run["files"]) == ("done", 4, 4, 2, 1)


def test_archive_remove_restore_round_trips_every_row_exactly(kit, retention, mixed_ledger):
    leave = mixed_ledger["leave"]
    before = ledger_rows(kit, leave)
    assert before["audit"] and before["outbox"] and len(before["deliveries"]) > len(leave)
    runner = retention()

    report = runner.run()
    assert report.removed == len(leave)
    assert all(not rows for rows in ledger_rows(kit, leave).values())

    [key] = report.files
    assert runner.restore(key) == (len(leave), 0)
    assert ledger_rows(kit, leave) == before
    assert runner.restore(key) == (0, len(leave))  # a second restore writes nothing
    assert ledger_rows(kit, leave) == before


def test_a_run_that_dies_between_archive_and_removal_repeats_safely(kit, retention, mixed_ledger):
    leave = mixed_ledger["leave"]
    before = ledger_rows(kit, leave)

    def crash(manifest):
        raise RuntimeError("killed after the archive was verified")

    first = retention(before_removal=crash).run()
    assert (first.status, first.archived, first.removed) == ("failed", len(leave), 0)
    assert "killed after the archive" in first.error
    assert ledger_rows(kit, leave) == before  # nothing left the ledger

    second = retention().run()
    assert (second.status, second.archived, second.removed) == ("done", len(leave), len(leave))

    runner = retention()
    written = [runner.restore(key) for key in (*first.files, *second.files)]
    assert written == [(len(leave), 0), (0, len(leave))]  # each event written once
    assert ledger_rows(kit, leave) == before


def test_an_event_that_changed_after_it_was_archived_stays(kit, retention, mixed_ledger):
    redelivered = mixed_ledger["processed_old_2"]

    def redelivery(manifest):
        kit.execute("INSERT INTO ledger.deliveries (event_id, event_created, source) "
                    "SELECT id, stripe_created, 'webhook' FROM ledger.events WHERE id = %s", (redelivered,))

    report = retention(before_removal=redelivery).run()

    assert (report.removed, report.changed) == (len(mixed_ledger["leave"]) - 1, 1)
    assert kit.deliveries(redelivered) == 2  # its new delivery was not deleted unarchived
    again = retention().run()
    assert (again.archived, again.removed) == (1, 1)


def test_two_runners_at_once_one_runs_the_other_skips(kit, retention, mixed_ledger):
    inside, release = threading.Event(), threading.Event()

    def wait(manifest):
        inside.set()
        assert release.wait(10)

    reports = {}
    first = threading.Thread(target=lambda: reports.setdefault("first", retention(before_removal=wait).run()))
    first.start()
    assert inside.wait(10)
    reports["second"] = retention().run()
    release.set()
    first.join(10)

    assert reports["second"].status == "skipped"
    assert (reports["first"].status, reports["first"].removed) == ("done", len(mixed_ledger["leave"]))
    assert kit.query("SELECT count(*) AS n FROM ledger.retention_runs")[0]["n"] == 1


def test_a_released_hold_no_longer_keeps_its_event(kit, retention, mixed_ledger):
    runner = retention()
    assert runner.run().kept_by_hold == 2
    hold = mixed_ledger["event_hold"]
    assert runner.release(hold, actor="ops@example.test")
    assert not runner.release(hold, actor="ops@example.test")
    report = runner.run()
    assert mixed_ledger["held_by_id"] not in {r["id"] for r in kit.query("SELECT id FROM ledger.events")}
    assert (report.removed, report.kept_by_hold) == (1, 1)
    assert [h["customer_id"] for h in runner.holds()] == ["cus_held"]


class TruncatingStore(DirectoryStore):
    """A store that loses the end of each file it is given, and says nothing: a full disk, a bad copy."""

    def put(self, key, source):
        super().put(key, source)
        if key.endswith(".jsonl.gz"):
            target = self.root / key
            target.write_bytes(target.read_bytes()[:-20])


def test_nothing_leaves_the_ledger_unless_its_archive_reads_back_whole(kit, settings, tmp_path, mixed_ledger):
    leave = mixed_ledger["leave"]
    before = ledger_rows(kit, leave)
    runner = Retention(kit.pool("retention"), TruncatingStore(tmp_path / "bad"),
                       RetentionPolicy(processed_days=30, failed_days=60))

    report = runner.run()

    assert report.status == "failed" and "does not match its manifest" in report.error
    assert (report.archived, report.removed) == (0, 0)
    assert ledger_rows(kit, leave) == before
    assert runner.catalogued_files() == []


def test_without_an_archive_nothing_leaves(kit, settings):
    runner = Retention(kit.pool("retention"), None, RetentionPolicy())
    with pytest.raises(ConfigError, match="LEDGER_ARCHIVE_URL"):
        runner.run()


@pytest.mark.parametrize("variable", ["LEDGER_RETAIN_PROCESSED_DAYS", "LEDGER_RETAIN_FAILED_DAYS"])
def test_a_window_under_thirty_days_is_refused_at_start_up(settings, variable):
    from ledger.config import Settings

    with pytest.raises(ConfigError, match=f"{variable} must be at least 30"):
        Settings.from_env({"DATABASE_URL": settings.database_url, variable: "29"})
    with pytest.raises(ConfigError):
        dataclasses.replace(settings, retain_processed_days=7)


def _local(store: DirectoryStore, key: str):
    return store.root / key


def test_the_sweep_runs_retention_on_its_schedule_and_counts_it(kit, settings, store, mixed_ledger):
    from ledger.attempts import WorkerLedger
    from workers import metrics
    from workers.app import make_celery
    from workers.sweep import Sweeper

    on = dataclasses.replace(settings, archive_url=str(store.root), retention_interval_s=0.2,
                             retain_processed_days=30, retain_failed_days=60)
    runner = Retention(kit.pool("retention", on), store, on.retention_policy())
    done = metrics.RETENTION_RUNS.labels("done")._value.get()

    Sweeper(WorkerLedger(kit.pool("sweep")), RecordingWaker(), make_celery(on), on,
            retention=runner).run_forever(stop_after=1.0)

    runs = runner.recent_runs(100)
    assert len(runs) >= 2 and all(r["status"] == "done" for r in runs)
    assert sum(r["removed"] for r in runs) == len(mixed_ledger["leave"])
    assert metrics.RETENTION_RUNS.labels("done")._value.get() - done == len(runs)
    health = runner.health()
    assert health["last_success_s"] > 0 and health["last_failed"] is False


def test_the_sweep_never_runs_retention_without_an_archive(kit, settings, mixed_ledger):
    from ledger.attempts import WorkerLedger
    from workers.app import make_celery
    from workers.sweep import Sweeper

    on = dataclasses.replace(settings, retention_interval_s=0.2)
    runner = Retention(kit.pool("retention", on), None, on.retention_policy())
    Sweeper(WorkerLedger(kit.pool("sweep")), RecordingWaker(), make_celery(on), on,
            retention=runner).run_forever(stop_after=0.5)
    assert runner.recent_runs() == []


def _month_partition(kit) -> tuple:
    """The month of the mixed ledger's events (~200 days old, older than the months a partitioned ledger
    starts with) as a partition of its own, made before they are recorded."""
    month = kit.query("SELECT date_trunc('month', now() - interval '200 days')::date AS m")[0]["m"]
    kit.execute("SELECT ledger.partition_create(%s)", (month,))
    return month, f"{month:%Y_%m}"


def _leftover_tables(kit) -> list[str]:
    return [r["t"] for r in kit.query("SELECT relname::text AS t FROM pg_class WHERE relname ~ '_(kept|gone)$'")]


def test_a_month_past_the_window_leaves_as_tables_and_what_it_kept_stays_exactly(partitioned_kit, store):
    kit = partitioned_kit
    month, suffix = _month_partition(kit)
    mixed_ledger = build_mixed_ledger(kit)
    everything = {v for v in mixed_ledger.values() if isinstance(v, str)}
    assert {r["p"] for r in kit.query("SELECT DISTINCT tableoid::regclass::text AS p FROM ledger.events")} == {
        f"ledger.events_{suffix}"}
    old_tables = kit.query("SELECT %s::regclass::oid AS e, %s::regclass::oid AS d, %s::regclass::oid AS a",
                           (f"ledger.events_{suffix}", f"ledger.deliveries_{suffix}", f"ledger.attempts_{suffix}"))[0]
    leave = mixed_ledger["leave"]
    kept = everything - leave
    before = ledger_rows(kit, everything)
    runner = Retention(kit.pool("retention"), store, RetentionPolicy(processed_days=30, failed_days=60))

    report = runner.run()

    assert report.status == "done", report.error
    assert (report.removed, report.partitions_dropped, report.kept_in_month, report.months_deferred) == (
        len(leave), 1, len(kept), 0)
    # The month's partitions are new tables holding what it kept, every row as it was; the old ones, and
    # every table the swap staged, are gone; the kept events still deduplicate.
    now = kit.query("SELECT %s::regclass::oid AS e, %s::regclass::oid AS d, %s::regclass::oid AS a",
                    (f"ledger.events_{suffix}", f"ledger.deliveries_{suffix}", f"ledger.attempts_{suffix}"))[0]
    assert not set(now.values()) & set(old_tables.values())
    assert _leftover_tables(kit) == []
    assert ledger_rows(kit, kept) == _only(before, kept)
    assert {r["p"] for r in kit.query("SELECT DISTINCT tableoid::regclass::text AS p FROM ledger.events")} == {
        f"ledger.events_{suffix}"}
    assert kit.query("SELECT count(*) AS n FROM ledger.audit WHERE event_id = ANY(%s)", (list(leave),)) == [{"n": 0}]
    assert kit.query("SELECT month, kept, run_id FROM ledger.dropped_partitions") == [
        {"month": month, "kept": len(kept), "run_id": report.run_id}]
    assert Partitions(kit.pool()).health().strays == 0
    [run] = runner.recent_runs(1)
    assert (run["partitions_dropped"], run["removed"]) == (1, len(leave))

    [key] = report.files
    assert runner.restore(key) == (len(leave), 0)
    assert ledger_rows(kit, everything) == before
    # Restored, they are past their window again: the next run takes them again, the same way.
    again = runner.run()
    assert (again.removed, again.partitions_dropped, again.kept_in_month) == (len(leave), 1, len(kept))
    assert ledger_rows(kit, kept) == _only(before, kept)


def test_a_month_keeps_the_events_that_changed_while_it_was_replaced(partitioned_kit, store):
    """Between the archive and the swap a processed event gets a redelivery (the file holds it without)
    and a kept one is processed: both stay, each as it is now, and the archived one's next run archives it."""
    kit = partitioned_kit
    month, suffix = _month_partition(kit)
    mixed_ledger = build_mixed_ledger(kit)
    redelivered, finished = mixed_ledger["processed_old_2"], mixed_ledger["received_old"]

    def meanwhile(manifest):
        kit.execute("INSERT INTO ledger.deliveries (event_id, event_created, source) "
                    "SELECT id, stripe_created, 'webhook' FROM ledger.events WHERE id = %s", (redelivered,))
        kit.execute("UPDATE ledger.events SET status = 'processed', processed_at = now() WHERE id = %s", (finished,))

    runner = Retention(kit.pool("retention"), store, RetentionPolicy(processed_days=30, failed_days=60),
                       before_removal=meanwhile)
    report = runner.run()

    assert report.status == "done", report.error
    assert (report.removed, report.changed, report.partitions_dropped) == (len(mixed_ledger["leave"]) - 1, 1, 1)
    assert kit.deliveries(redelivered) == 2
    assert kit.query("SELECT status FROM ledger.events WHERE id = %s", (finished,)) == [{"status": "processed"}]
    assert kit.query("SELECT count(*) AS n FROM ledger.partition_changes") == [{"n": 0}]
    assert _leftover_tables(kit) == []


def test_a_run_that_died_inside_a_month_replacement_is_finished_by_the_next(partitioned_kit, store):
    kit = partitioned_kit
    _month_partition(kit)
    mixed_ledger = build_mixed_ledger(kit)
    everything = {v for v in mixed_ledger.values() if isinstance(v, str)}
    before = ledger_rows(kit, everything)

    def die(manifest):
        raise RuntimeError("the runner's host went away")

    policy = RetentionPolicy(processed_days=30, failed_days=60)
    original = Retention._replace_month

    def stage_then_die(self, report, key, month, ids):
        # Archived ids written and the month staged, then the process is gone before its swap.
        from datetime import date

        from ledger.queries import SQL
        first = date.fromisoformat(f"{month}-01")
        with self._pool.get().connection() as conn, conn.transaction():
            with conn.cursor().copy(SQL.retention_archived_copy) as copy:
                for event_id in ids:
                    copy.write_row((report.run_id, first, event_id))
        self._all(SQL.partition_month_stage, {"run_id": report.run_id, "month": first})
        raise RuntimeError("the runner's host went away")

    Retention._replace_month = stage_then_die
    try:
        assert Retention(kit.pool("retention"), store, policy).run().status == "failed"
    finally:
        Retention._replace_month = original
    assert _leftover_tables(kit) != [] and ledger_rows(kit, everything) == before

    report = Retention(kit.pool("retention"), store, policy).run()

    assert report.status == "done", report.error
    assert (report.removed, report.partitions_dropped) == (len(mixed_ledger["leave"]), 1)
    assert _leftover_tables(kit) == []
    assert kit.query("SELECT count(*) AS n FROM ledger.retention_archived") == [{"n": 0}]
    assert ledger_rows(kit, everything - mixed_ledger["leave"]) == _only(before, everything - mixed_ledger["leave"])


def _only(rows: dict[str, list[str]], ids) -> dict[str, list[str]]:
    """ledger_rows' rows of these events alone."""
    return {table: [r for r in found if json.loads(r).get("id" if table == "events" else "event_id") in ids]
            for table, found in rows.items()}
