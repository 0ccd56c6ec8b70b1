"""Archive lines built outside Postgres (ledger/archive_lines.py) are, byte for byte, the lines the SQL
of migration 0013 wrote into every archive file before: so a file written before and one written after
restore alike, and their checksums mean the same thing. The SQL is taken from the migration's own file
and created for the comparison only, in a transaction rolled back after it.
"""
from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from ledger.archive_lines import LineBuilder, versions
from tests.support.retention import LEDGER_TABLES, build_mixed_ledger, ledger_rows

MIGRATION_0013 = Path(__file__).parents[2] / "ledger" / "migrations" / "0013_archive_lines.sql"
EVERY_EVENT = "SELECT {columns} FROM ledger.events e WHERE e.id = ANY (%(ids)s::text[])"
NO_MONTH = {"created_from": None, "created_to": None}


def built(url: str, ids: list[str]) -> dict[str, str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {line.event_id: line.text for line in LineBuilder(conn).lines(EVERY_EVENT, {}, {"ids": ids}, NO_MONTH)}


def written_by_0013(url: str, ids: list[str], time_zone: str = "UTC") -> dict[str, str]:
    with psycopg.connect(url) as conn:
        conn.execute(f"SET LOCAL TIME ZONE '{time_zone}'")
        conn.execute(MIGRATION_0013.read_text())
        found = dict(conn.execute("SELECT id, line FROM ledger.event_archive_lines(%s::text[])", (ids,)).fetchall())
        conn.rollback()
    return found


def test_every_state_of_the_retention_ledger_builds_the_lines_0013_wrote(kit):
    build_mixed_ledger(kit)
    ids = [r["id"] for r in kit.query("SELECT id FROM ledger.events")]
    mine, theirs = built(kit.settings.database_url, ids), written_by_0013(kit.settings.database_url, ids)
    assert mine == theirs
    assert any('"outbox" : [{' in line for line in mine.values()) and any('"audit" : [{' in line for line in mine.values())


texts = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=40)
moments = st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30),
                       timezones=st.just(timezone.utc))
documents = st.recursive(st.none() | st.booleans() | st.integers() | texts,
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                         max_leaves=8)


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(error=st.none() | texts, api_version=st.none() | texts, payload=documents, indent=st.none() | st.integers(0, 3),
       created=moments, deliveries=st.lists(moments, max_size=3, unique=True), reason=texts, effect=documents,
       livemode=st.booleans())
def test_any_values_build_the_lines_0013_wrote(kit, error, api_version, payload, indent, created, deliveries,
                                                reason, effect, livemode):
    event_id = "evt_lines_property"
    kit.execute("DELETE FROM ledger.events WHERE id = %s", (event_id,))
    kit.execute("INSERT INTO ledger.events (id, type, status, stripe_created, livemode, api_version, payload, "
                "last_error, processed_at, updated_at) VALUES (%s, 'customer.updated', 'processed', %s, %s, %s, %s, "
                "%s, %s, now())", (event_id, created, livemode, api_version,
                                   json.dumps({"id": event_id, "data": payload}, indent=indent, ensure_ascii=False),
                                   error, created + timedelta(microseconds=7)))
    for at in deliveries:
        kit.execute("INSERT INTO ledger.deliveries (event_id, event_created, delivered_at, source) "
                    "VALUES (%s, %s, %s, 'webhook')", (event_id, created, at))
    kit.execute("INSERT INTO ledger.audit (event_id, event_created, action, actor, reason, from_status) "
                "VALUES (%s, %s, 'replay', 'ops@example.test', %s, 'failed_permanent')", (event_id, created, reason))
    kit.execute("INSERT INTO ledger.outbox (idempotency_key, effect, event_id, event_created, payload, status) "
                "VALUES (%s, 'test.effect', %s, %s, %s, 'pending')",
                (f"{event_id}:e", event_id, created, json.dumps(effect, ensure_ascii=False)))
    try:
        assert built(kit.settings.database_url, [event_id]) == written_by_0013(kit.settings.database_url, [event_id])
    finally:
        kit.execute("DELETE FROM ledger.events WHERE id = %s", (event_id,))


def test_a_line_written_in_another_time_zone_restores_the_same_rows(kit):
    """Files written before say their timestamps in the writer's session time zone; the lines built now say
    +00:00. Both restore to the same rows."""
    ids = [r["id"] for r in kit.query("SELECT id FROM ledger.events WHERE status = 'processed' LIMIT 3")] or \
        [build_mixed_ledger(kit)["processed_old"]]
    before = ledger_rows(kit, ids)
    for lines in (written_by_0013(kit.settings.database_url, ids, "Asia/Kolkata"),
                  built(kit.settings.database_url, ids)):
        for table in reversed(LEDGER_TABLES):
            column = "id" if table == "events" else "event_id"
            kit.execute(f"DELETE FROM ledger.{table} WHERE {column} = ANY(%s)", (ids,))
        assert kit.query("SELECT ledger.event_restore_line(l) AS ok FROM unnest(%s::text[]) AS l",
                         (list(lines.values()),))
        assert ledger_rows(kit, ids) == before


def test_a_version_changes_with_any_row_its_line_holds(kit):
    event_id = build_mixed_ledger(kit)["processed_old"]
    url = kit.settings.database_url
    with psycopg.connect(url, autocommit=True) as conn:
        [line] = LineBuilder(conn).lines(EVERY_EVENT, {}, {"ids": [event_id]}, NO_MONTH)
        assert versions(conn, [event_id], NO_MONTH) == {event_id: line.version}
        conn.execute("INSERT INTO ledger.deliveries (event_id, event_created, source) "
                     "SELECT id, stripe_created, 'catchup' FROM ledger.events WHERE id = %s", (event_id,))
        appended = versions(conn, [event_id], NO_MONTH)[event_id]
        assert appended != line.version
        conn.execute("UPDATE ledger.attempts SET error = 'rewritten' WHERE event_id = %s", (event_id,))
        assert versions(conn, [event_id], NO_MONTH)[event_id] != appended
        conn.execute("DELETE FROM ledger.events WHERE id = %s", (event_id,))
        assert versions(conn, [event_id], NO_MONTH) == {}


def test_a_column_of_a_type_no_line_can_hold_is_refused_by_name(fresh_db):
    from ledger.migrate import migrate

    migrate(fresh_db)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("ALTER TABLE ledger.audit ADD COLUMN note_point point")
        with pytest.raises(TypeError, match="ledger.audit.note_point is a point"):
            LineBuilder(conn)


def test_builders_run_niced_and_return_a_slices_lines_in_order(kit):
    from ledger.archive_builders import Builders, Slice
    from ledger.config import RetentionBudget

    build_mixed_ledger(kit)
    blocks = kit.query("SELECT pg_relation_size('ledger.events') / 8192 AS n")[0]["n"]
    slices = [Slice("ledger.events", first, first + 1, NO_MONTH) for first in range(blocks)]
    with Builders(kit.settings, RetentionBudget(max_rate=0, builders=2, nice=7)) as builders:
        assert {builders._pool.submit(os.nice, 0).result() for _ in range(4)} == {7}
        chunks = list(builders.chunks(slices, {"processed_days": 30, "failed_days": 60}))
    assert len(chunks) == len(slices)
    archived = [event_id for by_month in chunks for chunk in by_month.values() for event_id, _ in chunk.versions]
    expected = kit.query("SELECT id FROM ledger.events e WHERE ledger.event_past_window(e.status, e.processed_at, "
                         "e.updated_at, 30, 60) ORDER BY ctid")
    assert archived and archived == [r["id"] for r in expected if r["id"] in set(archived)]
    assert builders.cpu_s > 0
