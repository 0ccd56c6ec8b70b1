"""Migrations run outside a transaction (ledger/index_builds.py): an index built while the receiver
writes, one interrupted mid-build and built again, and one on a partitioned ledger."""
from __future__ import annotations

import re
import threading
import time

import psycopg
import pytest

from ledger.errors import MigrationError
from ledger.index_builds import parse
from ledger.migrate import available_migrations, migrate, pending
from ledger.partition_migration import PartitionMigration

INDEX_MIGRATION = next(m for m in available_migrations() if not m.in_transaction)
BEFORE = INDEX_MIGRATION.version - 1
OBJECT_INDEX = "events_object_idx"
# Migration 0020: the console's covering indexes, and the index each replaces.
COVERING_MIGRATION = next(m for m in available_migrations() if "events_failed_idx" in m.sql)
COVERING_INDEXES = {"events_failed_idx": "events_failed_permanent_idx",
                    "events_processing_lease_idx": "events_processing_liveness_idx"}


def _insert_event(conn, n: int) -> None:
    conn.execute("INSERT INTO ledger.events (id, type, stripe_created, livemode, payload, object_id) "
                 "VALUES (%s, 'customer.updated', now(), false, '{}'::json, %s)", (f"evt_idx{n}", f"cus_{n}"))


def _validity(url: str, name: str):
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)",
                           (f"ledger.{name}",)).fetchone()
    return None if row is None else row[0]


def _build_backend(url: str, timeout: float = 20.0) -> int:
    """The pid of the session building an index, once it is building (waiting on a writer counts)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute("SELECT pid FROM pg_stat_progress_create_index WHERE datname = current_database()"
                               ).fetchone()
            if row:
                return row[0]
            time.sleep(0.05)
    raise AssertionError("no index build started")


@pytest.fixture
def ledger_before_the_index(fresh_db):
    migrate(fresh_db, upto=BEFORE)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        for n in range(50):
            _insert_event(conn, n)
    return fresh_db


def test_the_receiver_inserts_while_the_index_is_built(ledger_before_the_index):
    url = ledger_before_the_index
    writer = psycopg.connect(url)
    _insert_event(writer, 1000)  # a transaction in flight: the build waits for it to end
    said: list[str] = []
    build = threading.Thread(target=lambda: migrate(url, say=said.append))
    build.start()
    try:
        _build_backend(url)
        with psycopg.connect(url, autocommit=True) as receiver:
            receiver.execute("SET lock_timeout = '2s'")  # an index built in a transaction would hold this
            _insert_event(receiver, 1001)
    finally:
        writer.commit()
        writer.close()
        build.join(60)

    assert _validity(url, OBJECT_INDEX) is True
    assert pending(url) == []
    assert any(f"building index ledger.{OBJECT_INDEX} on ledger.events" in line and "concurrently" in line
               for line in said), said


def test_a_build_interrupted_midway_is_found_invalid_and_built_again(ledger_before_the_index):
    url = ledger_before_the_index
    writer = psycopg.connect(url)
    _insert_event(writer, 1000)
    failed: list[Exception] = []

    def run():
        try:
            migrate(url)
        except Exception as exc:  # noqa: BLE001 - what the interruption gives is asserted below
            failed.append(exc)

    build = threading.Thread(target=run)
    build.start()
    try:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (_build_backend(url),))
    finally:
        writer.rollback()
        writer.close()
        build.join(60)

    assert failed and isinstance(failed[0], psycopg.OperationalError)
    assert _validity(url, OBJECT_INDEX) is False  # what an interrupted concurrent build leaves
    assert [m.version for m in pending(url)] == [m.version for m in available_migrations() if m.version > BEFORE]

    said: list[str] = []
    migrate(url, say=said.append)

    assert _validity(url, OBJECT_INDEX) is True
    assert pending(url) == []
    assert any("INVALID" in line and OBJECT_INDEX in line for line in said), said


def test_on_a_partitioned_ledger_every_partition_gets_the_index(fresh_db, settings):
    import dataclasses

    from ledger.db import ProcessPool

    migrate(fresh_db, upto=BEFORE)
    pool = ProcessPool(dataclasses.replace(settings, database_url=fresh_db), name="partitions")
    try:
        assert PartitionMigration(pool).run().status == "done"
    finally:
        pool.close()

    migrate(fresh_db)

    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("SELECT ledger.partition_create((date_trunc('month', now()) + interval '6 months')::date)")
        partitions = {r[0] for r in conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'ledger.events'::regclass")}
        indexed = {r[0] for r in conn.execute(
            "SELECT t.relname FROM pg_inherits i JOIN pg_index x ON x.indexrelid = i.inhrelid "
            "JOIN pg_class t ON t.oid = x.indrelid WHERE i.inhparent = to_regclass('ledger.events_object_idx') "
            "AND x.indisvalid")}
    assert len(partitions) > 1
    assert indexed == partitions  # the later month's too, from the parent
    assert _validity(fresh_db, OBJECT_INDEX) is True
    assert _validity(fresh_db, "events_received_at_id_idx") is None  # replaced (0019): a partitioned index dropped
    for built, replaced in COVERING_INDEXES.items():  # 0020: on every partition, and the ones replaced gone
        assert _validity(fresh_db, built) is True and _validity(fresh_db, replaced) is None


def test_a_migration_outside_a_transaction_holds_only_concurrent_index_builds():
    with pytest.raises(MigrationError, match="holds only"):
        parse("CREATE INDEX CONCURRENTLY IF NOT EXISTS a_idx ON ledger.events (id);\n"
              "ALTER TABLE ledger.events ADD COLUMN x text;")
    with pytest.raises(MigrationError, match="holds only"):
        parse("CREATE INDEX a_idx ON ledger.events (id);")  # not concurrent: it would hold writers
    with pytest.raises(MigrationError, match="builds at least one index"):
        parse("DROP INDEX CONCURRENTLY IF EXISTS ledger.a_idx;")
    built, dropped = parse("-- why\nCREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS a_idx ON ledger.events (id) WHERE x;"
                           "\nDROP INDEX CONCURRENTLY IF EXISTS ledger.b_idx;")
    assert (built.name, built.schema, built.table, built.definition, built.unique) == (
        "a_idx", "ledger", "events", "(id) WHERE x", True)
    assert (dropped.name, dropped.schema) == ("b_idx", "ledger")


def test_the_thin_filter_is_written_as_its_index_states_it():
    """The planner reads a partial index only for a query whose condition implies the index's: the console's
    thin filter and migration 0019's index say the same."""
    from ledger.event_query import _SOURCE_PREDICATES

    [migration] = [m for m in available_migrations() if "events_thin_received_at_id_idx" in m.sql]
    assert _SOURCE_PREDICATES["thin"].replace("e.type", "type") in migration.sql


def _insert_in_state(conn, n: int, status: str, reason: str | None = None, *, due: bool = False,
                     expired: bool = False) -> None:
    """An event in ``status`` written directly (as a ledger of before the migration holds them)."""
    at = "now() - interval '1 minute'" if due or expired else "now() + interval '1 hour'"
    conn.execute(
        "INSERT INTO ledger.events (id, type, status, failure_reason, stripe_created, livemode, payload, received_at, "
        "next_attempt_at, lease_owner, lease_expires_at, processed_at) "
        f"VALUES (%s, %s, %s, %s, now(), false, '{{}}'::json, now() - make_interval(mins => %s), "
        f"CASE WHEN %s = 'failed_recoverable' THEN {at} END, CASE WHEN %s = 'processing' THEN 'w:1' END, "
        f"CASE WHEN %s = 'processing' THEN {at} END, CASE WHEN %s = 'processed' THEN now() END)",
        (f"evt_cov{n}", f"invoice.t{n % 3}", status, reason, n, status, status, status, status))


def test_the_console_counts_are_read_from_the_covering_indexes_alone(fresh_db):
    """Migration 0020 on a ledger holding events in every state: its indexes are built, the ones they replace
    are gone, and the overview's counts and the failure groups need nothing else, with the exact answers."""
    from ledger.queries import SQL

    migrate(fresh_db, upto=COVERING_MIGRATION.version - 1)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        states = ([("processed", None, {})] * 5 + [("received", None, {})] * 4
                  + [("processing", None, {}), ("processing", None, {"expired": True})]
                  + [("failed_recoverable", "db_unavailable", {}),
                     ("failed_recoverable", "db_unavailable", {"due": True})]
                  + [("failed_permanent", "rejected_by_handler", {})] * 3
                  + [("failed_permanent", "unsupported_type", {})])
        for n, (status, reason, when) in enumerate(states):
            _insert_in_state(conn, n, status, reason, **when)

    said: list[str] = []
    migrate(fresh_db, say=said.append)

    for built, replaced in COVERING_INDEXES.items():
        assert _validity(fresh_db, built) is True and _validity(fresh_db, replaced) is None
        assert any(f"building index ledger.{built} on ledger.events" in line for line in said), said
        assert any(f"dropping index ledger.{replaced}" in line for line in said), said
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) ledger.events")  # every page all-visible: index-only reads need no heap
        conn.execute("SET enable_seqscan = off; SET enable_bitmapscan = off")  # an index scan needs enable_indexscan
        for statement, indexes in ((SQL.console_unfinished, ("events_processing_lease_idx", "events_failed_idx")),
                                   (SQL.console_failure_groups, ("events_failed_idx",))):
            plan = "\n".join(r[0] for r in conn.execute("EXPLAIN (ANALYZE, COSTS OFF) " + statement, {"limit": 200}))
            scans = re.findall(r"(\w+(?: \w+)* Scan)(?: using (\w+))? on events", plan)
            assert scans and {scan for scan, _ in scans} == {"Index Only Scan"}, plan  # never a row read for a column
            assert set(indexes) <= {index for _, index in scans}, plan
            assert set(re.findall(r"Heap Fetches: (\d+)", plan)) == {"0"}, plan
        unfinished = conn.execute(SQL.console_unfinished).fetchone()
        groups = conn.execute(SQL.console_failure_groups, {"limit": 200}).fetchall()
    # received, processing, failed_recoverable, failed_permanent, age (the oldest: 12 minutes), due, expired
    assert unfinished[:4] == (4, 2, 2, 4) and unfinished[5:] == (1, 1) and 12 * 60 <= unfinished[4] < 13 * 60
    assert sorted((status, reason, type_, n) for status, reason, type_, n, _, _ in groups) == [
        ("failed_permanent", "rejected_by_handler", "invoice.t0", 1),
        ("failed_permanent", "rejected_by_handler", "invoice.t1", 1),
        ("failed_permanent", "rejected_by_handler", "invoice.t2", 1),
        ("failed_permanent", "unsupported_type", "invoice.t1", 1),
        ("failed_recoverable", "db_unavailable", "invoice.t0", 1),
        ("failed_recoverable", "db_unavailable", "invoice.t2", 1)]
