"""ops/sabotage: prove the tests catch the bugs that would break exactly-once outcomes.

    ops/sabotage                    # every sabotage, then the table
    ops/sabotage --only no-fencing  # one (repeatable)
    ops/sabotage --list             # what each sabotage does and which tests it runs
    ops/sabotage --no-chaos         # leave tests/e2e/test_chaos.py out (faster)
    ops/sabotage --ours-only        # only the model and chaos tests, not the existing ones

For each named sabotage it copies the working tree (not .git, caches or the
hypothesis example database) to a temporary directory, applies the sabotage
there (exact text replacements, each required to match exactly once), runs the
relevant tests in that copy with the same interpreter, and prints one row:
sabotage, tests failed / run, the test files that failed, caught yes/no. A
baseline row runs every selected test file on an unmodified copy first: it must
pass, or the other rows mean nothing. The working tree is never modified.

Exit status 0 when the baseline passes and every sabotage is caught.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("SABOTAGE_PYTHON") or sys.executable
MODEL = "tests/integration/test_model_ledger.py"
CHAOS = "tests/e2e/test_chaos.py"
DIFFERENTIAL = "tests/integration/test_writers_differential.py"


@dataclass(frozen=True)
class Sabotage:
    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]   # (path, exact old text, new text)
    tests: tuple[str, ...]                     # besides the model test (and the chaos test)


SABOTAGES = (
    Sabotage(
        "no-fencing",
        "apply transaction no longer proves the lease is ours: lease_owner dropped from "
        "event_lock_if_lease_held and event_finish_if_lease_held (ledger/sql/events.sql)",
        (("ledger/sql/events.sql",
          "                    AND coalesce(status, '') = 'processing' AND lease_owner = %(lease_owner)s\n"
          "                    FOR NO KEY UPDATE",
          "                    AND coalesce(status, '') = 'processing'\n"
          "                    FOR NO KEY UPDATE"),
         ("ledger/sql/events.sql",
          "       AND coalesce(status, '') = 'processing' AND lease_owner = %(lease_owner)s\n"
          " RETURNING id\n), closed AS (\n    UPDATE ledger.attempts\n       SET outcome = 'processed'",
          "       AND coalesce(status, '') = 'processing'\n"
          " RETURNING id\n), closed AS (\n    UPDATE ledger.attempts\n       SET outcome = 'processed'")),
        ("tests/integration/test_worker_fencing.py",)),
    Sabotage(
        "set-based-fence-without-lease-owner",
        "the set-based apply's fence and finish no longer check the lease owner: "
        "events_lock_if_leases_held and events_finish_if_leases_held (ledger/sql/events.sql)",
        (("ledger/sql/events.sql",
          "    ON e.id = m.id AND e.stripe_created = m.created AND e.lease_owner = m.lease_owner\n",
          "    ON e.id = m.id AND e.stripe_created = m.created\n"),
         ("ledger/sql/events.sql",
          "     WHERE e.id = m.id AND e.stripe_created = m.created AND coalesce(e.status, '') = 'processing'\n"
          "       AND e.lease_owner = m.lease_owner\n",
          "     WHERE e.id = m.id AND e.stripe_created = m.created AND coalesce(e.status, '') = 'processing'\n")),
        ("tests/integration/test_worker_fencing.py", "tests/integration/test_worker_batch.py")),
    Sabotage(
        "retention-removes-before-verifying",
        "retention removes a month's events before reading its archive file back (Retention._store_and_remove, "
        "ledger/retention.py): a file the store lost or cut short is no longer caught before the events go",
        (("ledger/retention.py",
          "        fetch_verified(self.store, manifest, tmp / f\"{month}.read-back.jsonl.gz\")\n",
          "        self._remove(report, key, writer.versions(), self._month_bounds(month))\n"
          "        fetch_verified(self.store, manifest, tmp / f\"{month}.read-back.jsonl.gz\")\n"),),
        ("tests/integration/test_retention.py",)),
    Sabotage(
        "retention-removes-changed-events",
        "a removal no longer compares an event's rows with those its archive line was built from "
        "(Retention._remove_page, ledger/retention.py): a delivery or a replay after the archive is lost",
        (("ledger/retention.py",
          "            unchanged = [event_id for event_id in ids if now.get(event_id) == archived[event_id]]\n",
          "            unchanged = [event_id for event_id in ids if event_id in now]\n"),),
        ("tests/integration/test_retention.py",)),
    Sabotage(
        "retention-removes-recoverable",
        "retention's window also takes failed_recoverable events (ledger.event_past_window, "
        "ledger/migrations/0011_retention.sql): an event still able to complete would leave the ledger",
        (("ledger/migrations/0011_retention.sql",
          "        OR (status = 'failed_permanent' AND updated_at",
          "        OR (status IN ('failed_permanent', 'failed_recoverable') AND updated_at"),),
        ("tests/integration/test_retention.py",)),
    Sabotage(
        "dedupe-by-partition-key-alone",
        "event_record_delivery (ledger/sql/events.sql) no longer looks an id up before inserting it: a copy of an "
        "event with another `created` goes to another partition and becomes a second event",
        (("ledger/sql/events.sql",
          "     WHERE NOT EXISTS (SELECT 1 FROM existing)\n",
          "     WHERE true\n"),),
        ("tests/integration/test_partitions.py",)),
    Sabotage(
        "month-replacement-loses-kept-events",
        "a month past the window is replaced by empty tables instead of the events it keeps "
        "(ledger.partition_month_stage, ledger/migrations/0014_month_swap.sql): held, unfinished and failed "
        "events of the month are lost",
        (("ledger/migrations/0014_month_swap.sql",
          "'SELECT 1 FROM ledger.retention_archived a '",
          "'SELECT 1 WHERE true OR EXISTS (SELECT FROM ledger.retention_archived a) '"),),
        ("tests/integration/test_retention.py",)),
    Sabotage(
        "month-replacement-ignores-changes",
        "a month's swap keeps the rows as they were staged, not the events changed since the run began "
        "(ledger.partition_month_swap, ledger/migrations/0014_month_swap.sql): a redelivery of an archived event "
        "and a kept event's progress made meanwhile are lost",
        (("ledger/migrations/0014_month_swap.sql",
          "    ids := ARRAY(SELECT c.event_id FROM ledger.partition_changes c WHERE c.month = partition_month_swap.month);",
          "    ids := ARRAY[]::text[];"),),
        ("tests/integration/test_retention.py",)),
    Sabotage(
        "partition-migration-loses-updates",
        "the online partition migration's mirror (ledger.partition_migration_mirror, migration 0012) no longer "
        "copies updates of events: a claim or a finish made while the twins fill is lost at the swap",
        (("ledger/migrations/0012_partitions.sql",
          "    CREATE TRIGGER partition_mirror AFTER INSERT OR UPDATE OR DELETE ON ledger.events",
          "    CREATE TRIGGER partition_mirror AFTER INSERT OR DELETE ON ledger.events"),),
        ("tests/e2e/test_partition_migration.py",)),
    Sabotage(
        "partition-backfill-never-gives-way",
        "the online partition migration's backfill batches wait for writers' locks without a limit and are not "
        "run again when Postgres breaks a deadlock on them (ledger/partition_migration.py): a worker's claim "
        "that copies events the batch is copying deadlocks with it, and the migration or the claim fails",
        (("ledger/partition_migration.py", "BATCH_LOCK_MS = 100\n", "BATCH_LOCK_MS = 0\n"),
         ("ledger/partition_migration.py", "GAVE_WAY = (errors.LockNotAvailable, errors.DeadlockDetected)\n",
          "GAVE_WAY = ()\n")),
        ("tests/integration/test_partitions.py",)),
    Sabotage(
        "group-wakeup-answers-before-its-publish",
        "the receiver's grouped wake-ups wake the requests of a group before their message is published "
        "(Grouping._lead, workers/grouping.py): a request may answer enqueued before the broker took its wake-up",
        (("workers/grouping.py",
          "        try:\n            results = self._run([slot.item for slot in group])\n",
          "        for slot in group:\n            slot.ready.set()\n"
          "        try:\n            results = self._run([slot.item for slot in group])\n"),),
        ("tests/unit/test_grouping.py", "tests/unit/test_wakeup.py")),
    Sabotage(
        "non-idempotent-upsert",
        "every upsert overwrites whatever the event: the newer-than half of the order guard made always true "
        "(workers/rowsql.py, _guard)",
        (("workers/rowsql.py",
          '    newer = sql.SQL("(t.source_event_created, t.source_event_id) "\n'
          '                    "{op} (EXCLUDED.source_event_created, EXCLUDED.source_event_id)").format(\n'
          '        op=sql.SQL("<=" if or_same else "<"))',
          '    newer = sql.SQL("true")'),),
        ("tests/integration/test_billing_ordering.py", "tests/integration/test_billing_idempotency.py",
         DIFFERENTIAL)),
    Sabotage(
        "reduction-keeps-first-change",
        "a batch reduced by key keeps the first change of each row instead of the newest (workers/rows.py, plan)",
        (("workers/rows.py", "            if previous is None or change.order > previous.order:",
          "            if previous is None:"),),
        (DIFFERENTIAL,)),
    Sabotage(
        "from-status-of-the-batchs-first-row",
        "a subscription's transitions in a batch all chain from the batch's first row of it: the chain stops "
        "following the row after its first change (workers/rows.py, plan)",
        (("workers/rows.py", "                    tracked[key] = change.row",
          "                    tracked.setdefault(key, change.row)"),),
        (DIFFERENTIAL,)),
    Sabotage(
        "copy-flush-drops-a-table",
        "a rebuild's slice writer never flushes its written-once table (subscription_transitions) "
        "(workers/writers.py, SliceWriter.write)",
        (("workers/writers.py",
          "        for table, rows in the_plan.once.items():\n"
          "            written += self._merge(table, self._stage(table, rows))",
          "        for table, rows in list(the_plan.once.items())[1:]:\n"
          "            written += self._merge(table, self._stage(table, rows))"),),
        (DIFFERENTIAL,)),
    Sabotage(
        "received-duplicate-is-done",
        "receiver treats a duplicate of a `received` event as handled: record_delivery asks for a "
        "wake-up for received only when it inserted the row (ledger/deliveries.py)",
        (("ledger/deliveries.py",
          "needs_wakeup = status in (EventStatus.RECEIVED, EventStatus.FAILED_RECOVERABLE) or (",
          "needs_wakeup = row[\"inserted\"] or status is EventStatus.FAILED_RECOVERABLE or ("),),
        ("tests/integration/test_receiver_ledger.py", "tests/unit/test_wakeup.py")),
    Sabotage(
        "failure-marked-processed",
        "processor swallows a handler's exception and lets the apply transaction finish: the "
        "event is marked processed with whatever the handler wrote (EventProcessor._run_handlers, "
        "workers/processor.py)",
        (("workers/processor.py",
          "        self.registry.apply(context)\n",
          "        try:\n            self.registry.apply(context)\n"
          "        except Exception:\n            log.exception(\"handler failed\")\n"),),
        ("tests/unit/test_worker_failures.py", "tests/e2e/test_worker_retries.py")),
    Sabotage(
        "claim-without-status-check",
        "event_claim takes every id it is given, whatever its status or lease (and clears "
        "processed_at, so the schema's CHECKs accept it) (ledger/sql/events.sql)",
        (("ledger/sql/events.sql",
          "     WHERE id = ANY(%(ids)s)\n       AND (coalesce(status, '') = 'received'\n"
          "            OR (coalesce(status, '') = 'failed_recoverable' AND next_attempt_at <= now())\n"
          "            OR (coalesce(status, '') = 'processing' AND lease_expires_at < now()))\n"
          "       FOR NO KEY UPDATE SKIP LOCKED",
          "     WHERE id = ANY(%(ids)s)\n       FOR NO KEY UPDATE SKIP LOCKED"),
         ("ledger/sql/events.sql",
          "           redrives         = 0,\n           updated_at       = now()\n"
          "     WHERE (id, stripe_created) IN (SELECT id, stripe_created FROM claimable)",
          "           redrives         = 0,\n           processed_at     = NULL,\n           updated_at       = now()\n"
          "     WHERE (id, stripe_created) IN (SELECT id, stripe_created FROM claimable)")),
        ("tests/integration/test_worker_batch.py", "tests/e2e/test_worker_concurrency.py",
         "tests/integration/test_worker_processor.py")),
    Sabotage(
        "member-fence-without-lease-owner",
        "every event is applied under a fence and a finish that no longer check the lease owner: "
        "lease_owner dropped from the statements ApplyTransaction.member runs (ledger/attempts.py); the "
        "SQL itself keeps its guard",
        (("ledger/attempts.py",
          "            conn.execute(SQL.event_lock_if_lease_held, keys)\n            yield conn\n"
          "            conn.execute(SQL.event_finish_if_lease_held, keys)\n            conn.execute(f\"RELEASE",
          "            unfenced = \" AND lease_owner = %(lease_owner)s\"\n"
          "            conn.execute(SQL.event_lock_if_lease_held.replace(unfenced, \"\"), keys)\n"
          "            yield conn\n"
          "            conn.execute(SQL.event_finish_if_lease_held.replace(unfenced, \"\"), keys)\n"
          "            conn.execute(f\"RELEASE"),),
        ("tests/integration/test_worker_batch.py", "tests/integration/test_worker_fencing.py")),
    Sabotage(
        "member-not-rolled-back",
        "a member of a set-based apply transaction that failed is recorded as failed and the transaction "
        "goes on to its COMMIT (EventProcessor._apply_together, workers/processor.py): its writes commit "
        "with its batch-mates'",
        (("workers/processor.py",
          "                        raise _MemberFailed(member, failure) from exc\n",
          "                        lost[claim.event_id] = failure\n                        continue\n"),),
        ("tests/integration/test_worker_batch.py",)),
    Sabotage(
        "object-locks-not-taken",
        "the apply transaction locks no business object: object_keys (workers/handlers.py) names none, "
        "so batches sharing customers lock their rows in arrival order",
        (("workers/handlers.py",
          "            keys.add(value)\n    return keys\n",
          "            keys.add(value)\n    return set()\n"),),
        ("tests/integration/test_worker_locks.py",)),
    Sabotage(
        "object-locks-unordered",
        "a transaction that waits for its objects takes them in the order it met them, not the one "
        "global order (object_lock, ledger/sql/objects.sql)",
        (("ledger/sql/objects.sql",
          "  FROM (SELECT DISTINCT hashtextextended('ledger.object:' || key, 0) AS lock_id\n"
          "          FROM unnest(%(keys)s::text[]) AS key\n"
          "         ORDER BY lock_id) AS ordered",
          "  FROM (SELECT hashtextextended('ledger.object:' || key, 0) AS lock_id\n"
          "          FROM unnest(%(keys)s::text[]) AS key) AS ordered"),),
        ("tests/integration/test_worker_locks.py",)),
    Sabotage(
        "object-locks-held-while-waiting",
        "a transaction waiting for an object keeps the keys it took however long the wait (ApplyTransaction.lock, "
        "ledger/attempts.py: its waits unbounded), so a holder that does not let go holds up everyone behind it",
        (("ledger/attempts.py",
          "            conn.execute(f\"SET LOCAL lock_timeout = {OBJECT_WAIT_MS}\")\n",
          "            conn.execute(\"SET LOCAL lock_timeout = 0\")\n"),),
        ("tests/integration/test_worker_locks.py",)),
    Sabotage(
        "batch-held-past-its-bound",
        "an apply transaction never commits before its last member, however long it has been open "
        "(BATCH_HOLD_S, workers/processor.py): a handler that runs long holds up the members after it",
        (("workers/processor.py", "BATCH_HOLD_S = 1.0\n", "BATCH_HOLD_S = float(\"inf\")\n"),),
        ("tests/integration/test_worker_locks.py",)),
    Sabotage(
        "rescue-takes-live-owners",
        "the rescuer takes every leased event over, its owner alive or not: the liveness probe of "
        "event_rescue_if_owner_gone (ledger/sql/events.sql) calls every key gone",
        (("ledger/sql/events.sql",
          "    SELECT key, NOT pg_try_advisory_xact_lock(key) AS alive FROM owners\n), taken AS (\n    SELECT id\n"
          "      FROM ledger.events",
          "    SELECT key, false AS alive FROM owners\n), taken AS (\n    SELECT id\n"
          "      FROM ledger.events"),),
        ("tests/integration/test_worker_rescue.py",)),
    Sabotage(
        "replay-job-per-preview-unguarded",
        "a confirmed preview may start a second job: replay_job_create (ledger/sql/console.sql) loses its "
        "ON CONFLICT and migration 0009's preview_id index is no longer unique",
        (("ledger/sql/console.sql", "    ON CONFLICT (preview_id) DO NOTHING\n", ""),
         ("ledger/migrations/0009_console_guards.sql",
          "CREATE UNIQUE INDEX IF NOT EXISTS replay_jobs_preview_id_key",
          "CREATE INDEX IF NOT EXISTS replay_jobs_preview_id_key")),
        ("tests/integration/test_console.py",)),
    Sabotage(
        "nul-reaches-postgres",
        "a NUL character in a console value, a filter or a ledgerctl argument is let through "
        "(ledger.inputs.usable): the database driver refuses it, and the page answers 500",
        (("ledger/inputs.py", '    if "\\x00" in value:\n', "    if False:\n"),),
        ("tests/integration/test_console_hostile_input.py",)),
    Sabotage(
        "rebuild-sends-effects",
        "a rebuild applies events in the workers' context (workers/reproject.py builds an ApplyContext with the "
        "effects senders are configured for, not a RebuildContext): handlers record their effects again",
        (("workers/reproject.py", "    registry.apply(RebuildContext(\n        conn=None,",
          "    registry.apply(ApplyContext(\n        enabled_effects=frozenset({'invoice.payment_failed', "
          "'entitlements.changed'}), conn=writer.conn,"),),
        ("tests/integration/test_reproject.py", "tests/e2e/test_reproject_e2e.py")),
    Sabotage(
        "apply-loses-events-processed-meanwhile",
        "an apply switches the rebuilt tables in without the events processed since the rebuild was built "
        "(workers/reproject.py: no catch-up before the lock, none under it)",
        (("workers/reproject.py",
          "            self._catch_up_until_few(conn, run[\"id\"], \"built\", SHADOW)\n", ""),
         ("workers/reproject.py",
          "                    self._catch_up(conn, run[\"id\"], run[\"state\"], catch_up_into, locked=True)\n", "")),
        ("tests/e2e/test_reproject_e2e.py",)),
)


def copy_tree(dest: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", "__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info",
                                    ".devstack", ".venv", "*.pyc")
    shutil.copytree(REPO, dest, ignore=ignore, symlinks=True)
    return dest


def apply(sabotage: Sabotage, root: Path) -> None:
    for path, old, new in sabotage.edits:
        target = root / path
        text = target.read_text()
        found = text.count(old)
        if found != 1:
            raise SystemExit(f"sabotage {sabotage.name}: expected exactly one match in {path}, found {found}; "
                             "the code changed: update the sabotage")
        target.write_text(text.replace(old, new))


@dataclass
class Run:
    failed: int
    total: int
    failed_files: dict[str, int]
    failed_tests: list[str]
    seconds: float
    output: str


def run_tests(root: Path, files: list[str], timeout_s: float) -> Run:
    report = root / "sabotage-report.xml"
    # A caught bug is all a row needs: the property tests skip shrinking its example (minutes each).
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1", "SABOTAGE_RUN": "1"}
    env.pop("HYPOTHESIS_PROFILE", None)
    cmd = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *files]
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        output = f"timed out after {timeout_s}s\n{exc.stdout or ''}"
    seconds = time.monotonic() - started
    failed_files: dict[str, int] = {}
    failed_tests: list[str] = []
    total = failed = 0
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            total += 1
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
                parts = (case.get("classname") or "?").split(".")
                name = next((f for k in range(len(parts), 0, -1)
                             if (root / (f := "/".join(parts[:k]) + ".py")).exists()), ".".join(parts))
                failed_files[name] = failed_files.get(name, 0) + 1
                failed_tests.append(f"{name}::{case.get('name')}")
    else:
        failed, total = 1, 1
        failed_files["(pytest did not finish)"] = 1
    return Run(failed, total, failed_files, failed_tests, seconds, output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ops/sabotage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=[s.name for s in SABOTAGES], help="run only these")
    parser.add_argument("--list", action="store_true", help="describe the sabotages and exit")
    parser.add_argument("--no-chaos", action="store_true", help=f"do not run {CHAOS}")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmodified baseline run")
    parser.add_argument("--ours-only", action="store_true",
                        help=f"run only {MODEL} and {CHAOS}, not the existing tests listed per sabotage")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    parser.add_argument("--timeout-s", type=float, default=1800, help="per test run")
    args = parser.parse_args(argv)

    chosen = [s for s in SABOTAGES if not args.only or s.name in args.only]
    common = [MODEL] + ([] if args.no_chaos else [CHAOS])
    if args.list:
        for s in chosen:
            print(f"{s.name}: {s.what}\n    tests: {' '.join(common + list(s.tests))}")
        return 0

    workdir = Path(tempfile.mkdtemp(prefix="sabotage-"))
    rows: list[tuple[str, Run, bool]] = []
    try:
        if not args.no_baseline:
            files = sorted(set(common + [t for s in chosen if not args.ours_only for t in s.tests]))
            root = copy_tree(workdir / "baseline")
            print(f"[sabotage] baseline: {' '.join(files)}", file=sys.stderr, flush=True)
            run = run_tests(root, files, args.timeout_s)
            rows.append(("(baseline, no sabotage)", run, run.failed == 0))
            if run.failed:
                print(run.output[-5000:], file=sys.stderr)
        for s in chosen:
            root = copy_tree(workdir / s.name)
            apply(s, root)
            files = common + ([] if args.ours_only else list(s.tests))
            print(f"[sabotage] {s.name}: {' '.join(files)}", file=sys.stderr, flush=True)
            run = run_tests(root, files, args.timeout_s)
            rows.append((s.name, run, run.failed > 0))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"[sabotage] copies kept in {workdir}", file=sys.stderr)

    print("| sabotage | tests failed | failed in | caught | time |")
    print("|---|---|---|---|---|")
    for name, run, good in rows:
        where = ", ".join(f"{Path(f).name} ({n})" for f, n in sorted(run.failed_files.items())) or "-"
        caught = ("passes" if good else "FAILS") if name.startswith("(baseline") else ("yes" if good else "NO")
        print(f"| {name} | {run.failed} / {run.total} | {where} | {caught} | {run.seconds:.0f}s |")
    print("\nFailed tests:")
    for name, run, _ in rows:
        for test in run.failed_tests:
            print(f"  {name}: {test}")
    return 0 if all(good for _, _, good in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
