"""The online migration of a ledger that had events before migration 0012 (``ledgerctl partitions migrate``,
ledger/partition_migration.py), run as the installed command while the real receiver takes events and a real
worker processes them: no answer but 200, no event lost or doubled, every row of the history as it was.
On a bounded history here; docs/benchmarks.md ("Tried and not kept") has the 1,000,000-event run's swap."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading
import time
from collections import Counter

import psycopg

from devkit.factories import sign
from ledger.migrate import migrate
from tests.integration.test_migration_stripe_api import migrate_to
from tests.support.constants import WEBHOOK_SECRET
from tests.support.handlers_for_tests import ensure_test_tables
from tests.support.receiver import event_body, receiver_env

HISTORY = 20_000
HISTORY_SQL = """
INSERT INTO ledger.events (id, type, status, attempts, stripe_created, livemode, payload, received_at, processed_at)
SELECT 'evt_hist' || lpad(g::text, 8, '0'), 'test.effect', 'processed', 1,
       now() - (g % 420) * interval '1 day', false, json_build_object('n', g),
       now() - (g % 420) * interval '1 day' - interval '1 hour', now() - (g % 420) * interval '1 day'
  FROM generate_series(1, {n}) g;
INSERT INTO ledger.deliveries (event_id, delivered_at) SELECT id, received_at FROM ledger.events;
INSERT INTO ledger.deliveries (event_id, delivered_at, source)
SELECT id, received_at + interval '1 minute', 'catchup' FROM ledger.events WHERE id LIKE '%0';
INSERT INTO ledger.attempts (event_id, attempt, worker, lease_owner, started_at, finished_at, outcome)
SELECT id, 1, 'old:1', 'old', received_at, processed_at, 'processed' FROM ledger.events;
INSERT INTO ledger.audit (event_id, action, actor, reason, from_status)
SELECT id, 'replay', 'ops@example.test', 'history', 'failed_permanent' FROM ledger.events WHERE id LIKE '%00'
"""
# Each table's rows as text, without event_created (which the migration fills in), in a fixed order.
ROWS_SQL = {
    "events": "SELECT md5(string_agg(to_jsonb(t)::text, '|' ORDER BY id)) FROM ledger.events t "
              "WHERE id LIKE 'evt_hist%'",
    "deliveries": "SELECT md5(string_agg((to_jsonb(t) - 'event_created')::text, '|' ORDER BY event_id, delivered_at)) "
                  "FROM ledger.deliveries t WHERE event_id LIKE 'evt_hist%'",
    "attempts": "SELECT md5(string_agg((to_jsonb(t) - 'event_created')::text, '|' ORDER BY event_id, attempt)) "
                "FROM ledger.attempts t WHERE event_id LIKE 'evt_hist%'",
    "audit": "SELECT md5(string_agg((to_jsonb(t) - 'event_created')::text, '|' ORDER BY id)) "
             "FROM ledger.audit t WHERE event_id LIKE 'evt_hist%'",
}


def _history_rows(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        return {table: conn.execute(sql).fetchone()[0] for table, sql in ROWS_SQL.items()}


def test_a_ledger_with_events_is_partitioned_online_while_events_arrive_and_are_processed(
        fresh_db, redis_url, settings, start_receiver, worker_factory):
    migrate_to(fresh_db, 11)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute(HISTORY_SQL.format(n=HISTORY))
        ensure_test_tables(conn)
    assert [m.version for m in migrate(fresh_db)][0] == 12
    before = _history_rows(fresh_db)

    receiver = start_receiver(receiver_env(fresh_db, redis_url, WEBHOOK_SECRET), workers=2)
    worker = worker_factory(dataclasses.replace(settings, database_url=fresh_db), concurrency=2, label="during")
    sent: Counter = Counter()
    answers: Counter = Counter()
    stop = threading.Event()

    def send():
        n = 0
        while not stop.is_set():
            n += 1
            event_id = f"evt_during{n:08d}"
            body = event_body(event_id, type="test.effect", created=int(time.time()),
                              data={"object": {"id": f"obj_during_{n}"}})
            for _ in range(2 if n % 10 == 0 else 1):  # every tenth one comes twice
                answer = receiver.post(body.encode(), {"Stripe-Signature": sign(body, WEBHOOK_SECRET)})
                answers[answer.status_code] += 1
                sent[event_id] += 1
    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(1)
    try:
        run = subprocess.run(["ledgerctl", "partitions", "migrate", "--json"], capture_output=True, text=True,
                             env={**os.environ, "DATABASE_URL": fresh_db}, timeout=600)
        time.sleep(1)  # a moment of traffic on the partitioned ledger too
    finally:
        stop.set()
        sender.join()
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["status"] == "done" and report["events"] >= HISTORY, report

    assert set(answers) == {200}, (answers, receiver.log())
    with psycopg.connect(fresh_db) as conn:
        assert conn.execute("SELECT ledger.is_partitioned()").fetchone()[0]
        found = dict(conn.execute("SELECT e.id, (SELECT count(*) FROM ledger.deliveries d WHERE d.event_id = e.id) "
                                  "FROM ledger.events e WHERE e.id LIKE 'evt_during%'").fetchall())
        assert found == dict(sent), "an event acknowledged during the migration is missing or doubled"
        deadline = time.monotonic() + 120
        while conn.execute("SELECT count(*) FROM ledger.events WHERE id LIKE 'evt_during%' "
                           "AND status <> 'processed'").fetchone()[0] and time.monotonic() < deadline:
            time.sleep(0.5)
        # Every update a worker made during the migration (claim, finish) is in the partitioned tables.
        assert conn.execute("SELECT count(*) FROM ledger.events WHERE id LIKE 'evt_during%' AND status <> 'processed'"
                            ).fetchone()[0] == 0
        outcomes = Counter(outcome for (outcome,) in conn.execute(
            "SELECT outcome FROM ledger.attempts WHERE event_id LIKE 'evt_during%'").fetchall())
        assert outcomes == Counter({"processed": len(sent)}), outcomes
        effects = dict(conn.execute("SELECT event_id, count(*) FROM public.test_effects "
                                    "WHERE event_id LIKE 'evt_during%' GROUP BY 1").fetchall())
        assert effects == {event_id: 1 for event_id in sent}, worker.log()[-3000:]
        assert conn.execute("SELECT count(*) FROM ledger.events WHERE id LIKE 'evt_hist%'").fetchone()[0] == HISTORY
    assert _history_rows(fresh_db) == before
    print(f"\n{len(sent)} events sent during a migration of {HISTORY} ({sum(sent.values())} deliveries); "
          f"swap {report['swap_s'] * 1000:.0f} ms, phases {report['phases']}")
